"""The Optimizer's epoch rules on their own: made-up groups and swarms, virtual time."""

from plexus.optim.epoch_policy import (
    EpochAction,
    after_gradient_round,
    gradient_weight,
    newest_epoch,
    overtaken,
    should_load_state,
    state_weight,
)


def test_a_member_at_a_newer_epoch_makes_the_others_withdraw_their_gradients():
    assert gradient_weight(5, {"a": 5, "b": 5}, 32.0) == 32.0
    assert gradient_weight(5, {"a": 5, "b": 6}, 32.0) == 0.0
    assert gradient_weight(6, {"a": 5, "b": 6}, 32.0) == 32.0, "an older member withdraws itself, not us"
    assert gradient_weight(5, {"aux": None, "a": 5}, 8.0) == 8.0, "members without an epoch do not count"
    assert newest_epoch({"a": True, "b": [7, "digest"], "c": "x"}, 3) == 7, "bools are not epochs"


def test_state_rounds_change_nothing_across_epochs_or_between_identical_states():
    same = {"a": [4, "d1"], "b": [4, "d1"], "c": [4, "d1"]}
    assert state_weight(4, same, 1.0) == 0.0, "identical states stay bit for bit identical"
    forked = {"a": [4, "d1"], "b": [4, "d2"]}
    assert state_weight(4, forked, 1.0) == 1.0, "states that differ at one epoch are averaged"
    assert state_weight(4, {"a": [4, "d1"], "b": [5, "d2"]}, 1.0) == 0.0, "whole steps apart: not mixed"
    assert state_weight(4, {"a": [3, "d1"], "b": [3, "d2"]}, 1.0) == 0.0, "a group of another epoch"
    for gathered in (same, forked, {"a": [4, "d1"], "b": [5, "d2"]}):  # every member decides alike
        assert len({state_weight(value[0], gathered, 1.0) for value in gathered.values()}) == 1


def test_after_the_round():
    assert after_gradient_round(3, {"a": 3, "b": 3}, swarm_moved_on=False) is EpochAction.STEP_AVERAGED
    assert after_gradient_round(3, {"a": 3, "b": 4}, swarm_moved_on=False) is EpochAction.LOAD_STATE
    assert after_gradient_round(3, None, swarm_moved_on=False) is EpochAction.STEP_LOCAL, (
        "nobody stepped without us: our own gradients are the epoch's average of who is left"
    )
    assert after_gradient_round(3, None, swarm_moved_on=True) is EpochAction.LOAD_STATE, (
        "the swarm stepped without us: stepping alone would fork its epoch"
    )
    assert overtaken(3, 4) and not overtaken(3, 3) and not overtaken(4, 3)


def test_loading_state_is_retried_after_a_pause_when_no_donor_was_up_to_date():
    now = 100.0
    assert not should_load_state(5, 5, must_load=False, now=now, next_attempt=0.0)
    assert should_load_state(5, 6, must_load=False, now=now, next_attempt=0.0)
    assert not should_load_state(5, 6, must_load=False, now=now, next_attempt=now + 10), "pausing"
    assert should_load_state(5, 6, must_load=False, now=now + 10, next_attempt=now + 10)
    assert should_load_state(5, 5, must_load=True, now=now, next_attempt=now + 10), (
        "a round said we are behind"
    )
