"""Runtime settings, checked once and frozen (xshare/runtime/config.py), without a runtime."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from xshare import sched
from xshare.runtime.config import GROUP_AHEAD, RuntimeConfig


def test_preemptive_policies_keep_one_step_in_flight_and_throughput_policies_more():
    srtf, pack = RuntimeConfig.of(sched.Srtf()), RuntimeConfig.of(sched.Pack())
    assert (srtf.preemptive, srtf.dispatch_ahead, srtf.group_ahead) == (True, 1, 1)
    assert (pack.preemptive, pack.dispatch_ahead, pack.group_ahead) == (False, 8, GROUP_AHEAD)
    named = RuntimeConfig.of(sched.Pack(), dispatch_ahead=3)
    assert (named.dispatch_ahead, named.group_ahead) == (3, 3)  # a depth the user names holds for groups too
    assert named.staging == {"prefetch": 2, "ahead": 3, "group_ahead": 3}


def test_the_config_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        RuntimeConfig.of(sched.Pack()).quantum = 4  # type: ignore[misc]


@pytest.mark.parametrize("kw, message", [
    ({"quantum": 0}, r"quantum=0 must be an int >= 1"),
    ({"prefetch": True}, r"prefetch=True must be an int >= 1"),
    ({"dispatch_ahead": -1}, r"dispatch_ahead=-1 must be an int >= 0"),
    ({"slots": 1.5}, r"slots=1.5 must be an int >= 1"),
    ({"compile_workers": 0}, r"compile_workers=0 must be an int >= 1"),
    ({"group_capacity": 0, "fuse": True}, r"group_capacity=0 must be an int >= 1 \(slots per fused group\)"),
    ({"checkpoint_keep": 0}, r"checkpoint_keep=0 must be an int >= 1"),
    ({"checkpoint_every": 0, "log_dir": "x"}, r"checkpoint_every=0 must be an int >= 1 \(steps\), or None"),
    ({"checkpoint_every": 5}, r"checkpoint_every/resume need a checkpoint_dir \(or log_dir\)"),
    ({"resume": True}, r"checkpoint_every/resume need a checkpoint_dir"),
    ({"writers": ["tensorboard"]}, r"writers=\['tensorboard'\] need a log_dir"),
    ({"steps_per_call": 0}, r"steps_per_call=0 must be 'auto' or an int >= 1"),
    ({"steps_per_call": "fast"}, r"steps_per_call='fast' must be 'auto' or an int >= 1"),
])
def test_each_bad_setting_is_refused_naming_the_value_and_what_it_must_be(kw, message):
    with pytest.raises(ValueError, match=message):
        RuntimeConfig.of(sched.Pack(), **kw)


def test_checkpoints_need_a_reason_a_log_dir_alone_keeps_none():
    assert RuntimeConfig.of(sched.Pack(), log_dir="logs").checkpoint_dir is None
    assert RuntimeConfig.of(sched.Pack(), log_dir="logs", checkpoint_every=10).checkpoint_dir == Path("logs")
    assert RuntimeConfig.of(sched.Pack(), log_dir="logs", resume=True).checkpoint_dir == Path("logs")
    # an explicit directory: checkpoints at each job's end and on stop(), even without a period
    assert RuntimeConfig.of(sched.Pack(), checkpoint_dir="ck").checkpoint_dir == Path("ck")


def test_steps_per_call_auto_weighs_and_a_number_is_a_power_of_two_cap_the_user_forces():
    auto, seven = RuntimeConfig.of(sched.Pack()), RuntimeConfig.of(sched.Pack(), steps_per_call=7)
    assert (auto.steps_per_call, auto.steps_forced) == (32, False)
    assert (seven.steps_per_call, seven.steps_forced) == (4, True)


def test_group_capacity_means_nothing_without_fuse():
    assert RuntimeConfig.of(sched.Pack(), group_capacity=8).group_capacity is None
    assert RuntimeConfig.of(sched.Pack(), group_capacity=8, fuse=True).group_capacity == 8
