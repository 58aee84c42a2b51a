"""Offline training of a DFlash drafter (see train_dflash.py)."""
