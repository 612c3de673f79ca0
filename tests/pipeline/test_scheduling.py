"""The workers' scheduling policy where the platform refuses it."""

from __future__ import annotations

import os

import pytest

from pipeline import _scheduling


def test_a_refused_policy_is_a_warning_not_a_failure(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the kernel or a sandbox refuses SCHED_BATCH, the worker serves on as it was."""

    def refuse(pid: int, policy: int, param: object) -> None:
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "sched_setscheduler", refuse)
    assert _scheduling.apply_scheduling("batch") is False
    assert _scheduling.apply_scheduling("normal") is True


def test_a_platform_without_the_policy_is_a_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where os has no SCHED_BATCH (macOS), the policy is not in force and nothing raises."""
    monkeypatch.delattr(os, "SCHED_BATCH", raising=False)
    assert _scheduling.apply_scheduling("batch") is False
