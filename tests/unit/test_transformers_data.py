"""pliant.transformers' data plumbing: the sampler found under Accelerate's wrappers (for a callback the Trainer
rebuilt from a checkpoint), and the data position read back from a checkpoint's trainer_state.json."""

from __future__ import annotations

import json
from pathlib import Path

from pliant.data import GlobalBatchSampler
from pliant.transformers import _data_state, _sampler_of


class _Wrapper:
    """What Accelerate puts around a batch sampler: the one below as ``batch_sampler``."""

    def __init__(self, inner: object) -> None:
        self.batch_sampler = inner


def test_the_sampler_is_found_under_the_loaders_wrappers() -> None:
    sampler = GlobalBatchSampler(64, 4, 16, rank=0, world_size=2)
    assert _sampler_of(_Wrapper(_Wrapper(_Wrapper(sampler)))) is sampler
    assert _sampler_of(_Wrapper(sampler)) is sampler
    assert _sampler_of(_Wrapper(object())) is None
    assert _sampler_of(None) is None


def test_the_data_position_comes_back_from_the_checkpoint(tmp_path: Path) -> None:
    state = GlobalBatchSampler(64, 4, 16, rank=0, world_size=2).state_dict()
    saved = {"global_step": 7, "stateful_callbacks": {"Elastic": {"args": {}, "attributes": {"_data_state": state}}}}
    (tmp_path / "trainer_state.json").write_text(json.dumps(saved))
    assert _data_state(tmp_path) == state
    saved["stateful_callbacks"]["Elastic"] = [
        {"attributes": {"_data_state": None}},
        saved["stateful_callbacks"]["Elastic"],
    ]
    (tmp_path / "trainer_state.json").write_text(json.dumps(saved))
    assert _data_state(tmp_path) == state  # the last of several callbacks of the class
    (tmp_path / "trainer_state.json").write_text("{not json")
    assert _data_state(tmp_path) is None
    assert _data_state(tmp_path / "missing") is None
