"""The command-line side of rank sets: what ``capture``, ``compare`` and ``diff`` do under torchrun or on a set.

The other commands of this package route here (a few lines each): ``capture`` when the process
is one rank of a launch (:func:`parity.distributed.group.launched`), ``compare`` when it is, or when its
bundle is a rank set, ``diff`` when either side is a rank set. These functions take the parsed
arguments, apply the same checks as the single-process commands (trust, a policy file inside the
bundle, judging options) and return what the command prints or writes. Only rank 0 writes reports;
every rank exits with the same status.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
from pathlib import Path

from parity.base.errors import UsageError
from parity.judge.policy import policy_for_cli
from parity.judge.compare import trusted_for_run
from parity.run.subjects.base import add_cwd_to_sys_path, is_builtin, remove_from_sys_path

from parity.distributed.capture import capture_rank_set, stderr_progress
from parity.distributed.compare import compare_distributed, compare_rank_set, diff_sets, open_golden
from parity.distributed.group import join, launched
from parity.distributed.placement import PlacementMap

REPORT_FLAGS = ("json", "junit_xml", "html", "markdown")


def launch_rank() -> int:
    """This process's rank in a launch (``RANK``; 0 outside one)."""
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


def quiet_other_ranks(args: argparse.Namespace) -> None:
    """Reports (and the error reports of exit 2 and 3) are written by rank 0 alone."""
    if launch_rank() != 0:
        for dest in REPORT_FLAGS:
            if hasattr(args, dest):
                setattr(args, dest, None)


def placement_map(args: argparse.Namespace) -> PlacementMap:
    return PlacementMap.parse(getattr(args, "placements", None) or [])


def capture(args: argparse.Namespace, *, subject_args: dict, shard_bytes: int, device: str) -> int:
    """``capture`` on one rank of a launch: this rank's bundle, and on rank 0 the committed set."""

    if args.record_inputs:
        raise UsageError("--record-inputs is not available for a distributed capture (layers of a split model "
                         "cannot be replayed alone)")
    rules = placement_map(args)
    group = join(device)
    finished = False
    try:
        result = capture_rank_set(args.subject, args.out, subject_args=subject_args, impl=args.impl,
                                  layers=args.layers, reference=args.reference, placements=rules, force=args.force,
                                  shard_bytes=shard_bytes, durable=args.durable, group=group,
                                  reference_scope=args.reference_scope, weights_from=args.weights_from,
                                  progress=None if args.quiet else stderr_progress(group.rank, group.world_size))
        finished = True
    finally:  # after an error another rank may be gone: no barrier then
        group.close(synchronize=finished)
    if group.rank == 0:
        from parity.run.resources import summary_line

        print(f"wrote rank set {result.path}: {result.world_size} ranks, {len(result.placements)} recorded tensors "
              f"per rank; hooks on/off bitwise equal on every rank")
        print(f"capture cost on rank 0: {summary_line(result.resources)} (each rank's: capture.resources of its "
              "bundle)")
    return 0


def compare(args: argparse.Namespace, *, device: str | None, progress):
    """``compare`` of a rank set in one process, or of any golden under a launch.
    Returns ``(report or None, passed)``; the report is None on ranks other than 0."""

    if args.isolate:
        raise UsageError("--isolate is not available for rank sets or distributed runs (a layer of a split model "
                         "cannot be replayed alone)")
    view = open_golden(args.golden)  # reads manifests; imports and runs nothing
    root = Path(view.path).resolve()
    remove_from_sys_path(root)
    policy = policy_for_cli(args.tolerances, bundles=[view.path], strict_structure=args.strict_structure)
    trusted = trusted_for_run(args.subject, view.subject.get("spec"), view.path, policy.trusted_subjects)
    if not is_builtin(view.subject.get("spec")):
        add_cwd_to_sys_path()
        remove_from_sys_path(root)
    policy = dataclasses.replace(policy, trusted_subjects=trusted)
    if not launched():
        if getattr(args, "placements", None):
            raise UsageError("--placement applies to a distributed compare; run it under torchrun")
        report = compare_rank_set(view, impl=args.impl, device=device, policy=policy, budget=args.budget,
                                  progress=progress, weights_dir=args.weights_dir)
        return report, report.passed
    group = join(device)
    finished = False
    try:
        outcome = compare_distributed(view.path, impl=args.impl, policy=policy, budget=args.budget,
                                      placements=placement_map(args), progress=progress if group.rank == 0 else None,
                                      group=group, weights_dir=args.weights_dir)
        finished = True
    finally:  # after an error another rank may be gone: no barrier then
        group.close(synchronize=finished)
    return outcome


def diff(args: argparse.Namespace, progress):
    """``diff A B`` where A or B is a rank set."""

    golden, candidate = open_golden(args.golden), open_golden(args.candidate)
    policy = policy_for_cli(args.tolerances, bundles=[golden.path, candidate.path],
                            strict_structure=args.strict_structure)
    return diff_sets(golden, candidate, policy=policy, budget=args.budget, progress=progress)
