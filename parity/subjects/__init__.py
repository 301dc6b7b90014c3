"""Subjects: what capture and compare run, the same way on both hosts.

Built-ins are ``attention`` (the block-sparse op over named case sets) and ``decoder`` (a small
block-sparse decoder LM); a user's own subject is named ``package.module:factory``. The protocol
and the runner are in :mod:`parity.subjects.base`; built-in modules are imported on first use.
"""
from .base import (
    BUILTINS,
    DTYPES,
    Inputs,
    Subject,
    SubjectRunner,
    load_subject,
    parse_dtype,
    register_subject,
    runner_from_manifest,
)

__all__ = [
    "BUILTINS", "DTYPES", "Inputs", "Subject", "SubjectRunner",
    "load_subject", "parse_dtype", "register_subject", "runner_from_manifest",
]
