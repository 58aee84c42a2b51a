def test_smoke_tmp():
    import vllm
    import vllm_ddtree
    assert vllm.__version__.startswith("0.32")
    assert callable(vllm_ddtree.register)
