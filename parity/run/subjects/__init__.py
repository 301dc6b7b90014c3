"""Subjects: what capture and compare run, the same way on both hosts.

Built-ins are ``attention`` (the block-sparse op over named case sets) and ``decoder`` (a small
block-sparse decoder LM); a user's own subject is named ``package.module:factory``. The protocol,
the runner, and the trust rule for subjects named by a bundle are in :mod:`parity.run.subjects.base`;
built-in modules are imported on first use.
"""
from parity.run.subjects.base import (
    BUILTINS,
    DTYPES,
    Inputs,
    Subject,
    SubjectRunner,
    check_trusted,
    is_builtin,
    load_subject,
    parse_dtype,
    register_subject,
    runner_from_manifest,
    trust_subject,
    trusting,
)

__all__ = [
    "BUILTINS", "DTYPES", "Inputs", "Subject", "SubjectRunner", "check_trusted", "is_builtin",
    "load_subject", "parse_dtype", "register_subject", "runner_from_manifest", "trust_subject",
    "trusting",
]
