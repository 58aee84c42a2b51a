"""The lent GPU's calls carry at most 64 MiB each: the repository's tracked files plus
what the call names. The vLLM kit (scripts/gpu_kit.sh) and the SmolLM2 GGUF
(training/device_kit.sh) are cut into chunks so that one chunk, with the few MiB of
files that ride along (the OpenAI server's wheels, about 4.4 MiB), fits beside the
repository. A repository that grows (a new drafter in models/) must shrink the chunks."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LIMIT = 64 * 2**20
# What rides with a chunk: the kit's manifest and installer with the vLLM kit's; the
# OpenAI server's wheels, the gguf wheel, checksums and the gzipped prompt corpus with
# the GGUF's last chunk.
RIDERS = {"scripts/gpu_kit.sh": 2**20, "training/device_kit.sh": 6 * 2**20}


def tracked_bytes() -> int:
    names = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True,
                           check=True).stdout.decode().split("\0")
    return sum((ROOT / n).stat().st_size for n in names if n and (ROOT / n).is_file())


def chunk_bytes(script: str) -> int:
    """The ``split -b`` size a kit script cuts its chunks to (``NNM``, default included)."""
    found = re.search(r'split -b "?(?:\$\{CHUNK:-)?(\d+)M', (ROOT / script).read_text())
    assert found, f"{script}: no split -b NNM"
    return int(found.group(1)) * 2**20


@pytest.mark.parametrize("script", sorted(RIDERS))
def test_one_chunk_fits_a_call_beside_the_repository(script):
    repo, chunk, riders = tracked_bytes(), chunk_bytes(script), RIDERS[script]
    assert repo + chunk + riders <= LIMIT, (
        f"{script}: {chunk / 2**20:.0f} MiB chunks + {repo / 2**20:.1f} MiB of repository "
        f"+ {riders / 2**20:.0f} MiB riding along exceed a call's 64 MiB")
