"""Where things are, for every test: the checkout's root and the committed fixtures."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent  # the checkout: pretrain_gpt.py, tools/, scripts/
FIXTURES = ROOT / "tests" / "fixtures"  # files other tools (Megatron-LM, megatron-core) wrote
