"""The DP coordinator's lock-step votes, as pure logic."""
from __future__ import annotations

import pytest

from fleet.core.launch.dp_coordinator import WaveState
from fleet.core.messages import StepDecision, StepVote, WaveWakeUp


def test_first_vote_while_idle_wakes_the_others_and_all_votes_decide():
    waves = WaveState(num_engines=2)
    assert waves.vote(StepVote(0, 0, has_work=True)) == [WaveWakeUp(0)]
    assert waves.vote(StepVote(1, 0, has_work=False)) == [StepDecision(0, run=True)]


def test_a_running_wave_sends_no_wake_ups_and_ends_when_nobody_has_work():
    waves = WaveState(num_engines=2)
    waves.vote(StepVote(0, 0, True))
    waves.vote(StepVote(1, 0, False))
    assert waves.vote(StepVote(1, 1, False)) == []  # running: everyone votes on its own
    assert waves.vote(StepVote(0, 1, False)) == [StepDecision(1, run=False)]
    # Idle again: the next vote wakes the others.
    assert waves.vote(StepVote(1, 2, True)) == [WaveWakeUp(2)]


def test_a_vote_for_another_step_is_refused():
    waves = WaveState(num_engines=2)
    with pytest.raises(ValueError, match="voted for step 3 during step 0"):
        waves.vote(StepVote(0, 3, True))


def test_a_single_engine_decides_alone():
    waves = WaveState(num_engines=1)
    assert waves.vote(StepVote(0, 0, False)) == [WaveWakeUp(0), StepDecision(0, run=False)]
