"""What a golden bundle holds, read from its manifest (and its checksums verified): the library behind ``python -m parity show``.

:func:`describe_bundle` returns a JSON-ready description: the subject (spec and arguments), how
it was captured, the capture host's platform fingerprint, every stored tensor (kind, name, dtype,
shape, bytes; for a recorded output whether the bundle holds its high-precision reference and
how many module inputs were recorded for its layer), totals by kind, the shards, and whether
every checksum matched. :func:`render_show` turns it into text for people, in the manner of
``polygraphy inspect data``. Nothing named in the bundle is imported or run: the subject is
only a string here, the manifest is checked JSON, and tensors are read as bytes.
"""
from __future__ import annotations

import json
import os
from typing import Any

from tabulate import tabulate

from parity.base import jsonformat
from parity.base.text import printable
from parity.bundle.manifest import KINDS
from parity.bundle.reader import open_bundle

# Called "parity-show" before the JSON outputs shared one naming pattern (parity.base.jsonformat).
SHOW_FORMAT = jsonformat.SHOW_REPORT
SHOW_VERSION = jsonformat.version_of(SHOW_FORMAT)

# Fingerprint keys shown on the "numerics" line (the rest are in --json): what changes results.
_NUMERICS_LINE_KEYS = (
    "tf32_matmul", "tf32_cudnn", "float32_matmul_precision", "fp16_reduced_precision_reduction",
    "bf16_reduced_precision_reduction", "deterministic_algorithms", "triton_default_fp_fusion",
    "triton_f32_default", "blas_library", "linalg_library", "rocm_fa_library", "sdp_backends",
    "tunableop_enabled", "tunableop_tuning", "cudnn_version", "miopen_version", "numerics_env",
)


def describe_bundle(path: str | os.PathLike, *, verify: bool = True) -> dict[str, Any]:
    """Everything ``show`` reports about the bundle at ``path``; ``verify``: read every tensor
    and shard and check each checksum first (a mismatch raises :class:`~parity.base.errors.BundleError`)."""

    with open_bundle(path, rank_of_a_set=True) as bundle:  # a lone rank too: shown, judged nothing
        checked = bundle.verify() if verify else None
        raw = bundle.manifest
        outputs = bundle.entries_of("output")
        references = {entry.name for entry in bundle.entries_of("reference")}
        inputs_per_layer: dict[str, int] = {}
        for entry in bundle.entries_of("module_input"):
            inputs_per_layer[entry.layer or ""] = inputs_per_layer.get(entry.layer or "", 0) + 1
        tensors = []
        for entry in bundle.entries:
            item = {
                "kind": entry.kind, "name": entry.name, "dtype": entry.dtype, "shape": list(entry.shape),
                "bytes": entry.nbytes, "layer": entry.layer, "module": entry.module,
                "call_index": entry.call_index, "path": entry.path, "shard": entry.shard, "checksum": entry.checksum,
            }
            if entry.kind == "output":
                item["has_reference"] = entry.name in references
                item["module_inputs"] = inputs_per_layer.get(entry.layer or "", 0)
            tensors.append(item)
        totals = {kind: {"tensors": 0, "bytes": 0} for kind in KINDS}
        for entry in bundle.entries:
            totals[entry.kind]["tensors"] += 1
            totals[entry.kind]["bytes"] += entry.nbytes
        totals = {kind: count for kind, count in totals.items() if count["tensors"]}
        shards = [{"file": shard.file, "bytes": shard.bytes, "tensors": shard.tensors, "sha256": shard.sha256,
                   "header_checksum": shard.header_checksum}
                  for shard in bundle.shards]
        return {
            "format": SHOW_FORMAT,
            "version": SHOW_VERSION,
            "bundle": str(bundle.path),
            "bundle_format": raw.get("format"),
            "schema_version": bundle.schema_version,
            "sealed": bundle.sealed,
            "parity_version": raw.get("parity_version"),
            "created": raw.get("created"),
            "subject": bundle.subject,
            "impl": bundle.impl,
            "device": bundle.device,
            "capture": bundle.capture_info,
            "platform": bundle.platform,
            "kernel_configs": bundle.kernel_configs,
            "layers": len(bundle.layers()),
            "outputs": len(outputs),
            "outputs_with_reference": sum(entry.name in references for entry in outputs),
            "totals": totals,
            "total_bytes": sum(entry.nbytes for entry in bundle.entries),
            "shards": shards,
            "checksums": {"algorithm": bundle.checksum, "verified": checked is not None, "tensors": len(bundle.entries),
                          "ok": True if checked is not None else None},
            "tensors": tensors,
        }


# ---------------------------------------------------------------------------------------------
# Text


def _size(nbytes: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes} B"


def _shape(shape: list[int]) -> str:
    return "x".join(str(n) for n in shape) if shape else "scalar"


def _json_line(value: Any, limit: int = 400) -> str:
    return printable(json.dumps(value, ensure_ascii=False, sort_keys=False), limit=limit)


def _platform_lines(fp: dict[str, Any]) -> list[str]:
    host = " ".join(str(fp[key]) for key in ("vendor", "arch", "device_name") if fp.get(key))
    versions = ", ".join(f"{label} {fp[key]}" for label, key in (
        ("torch", "torch"), ("triton", "triton"), ("cuda", "cuda_version"), ("hip", "hip_version"),
        ("rocm", "rocm_version"), ("driver", "driver"), ("python", "python")) if fp.get(key) is not None)
    lines = [f"  platform: {printable(host or '?')}" + (f"; {printable(versions)}" if versions else "")
             + ("; Triton interpreter" if fp.get("triton_interpreter") else "")]
    numerics = [f"{key}={printable(fp[key] if not isinstance(fp[key], dict) else json.dumps(fp[key]), limit=200)}"
                for key in _NUMERICS_LINE_KEYS if key in fp and fp[key] not in (None, {}, "")]
    unknown = [key for key in _NUMERICS_LINE_KEYS if key not in fp]
    if numerics:
        lines.append("  numerics: " + ", ".join(numerics))
    if unknown:
        lines.append(f"  not recorded (bundle older than these fields): {', '.join(unknown)}")
    return lines


def _subject_line(subject: dict[str, Any]) -> str:
    return (f"  subject: {printable(subject.get('name') or subject.get('spec'))} (spec {printable(subject.get('spec'))}); "
            f"args {_json_line(subject.get('args', {}))}")


def _table(rows: list[list[Any]], headers: list[str]) -> str:
    """Rows whose second cell is a name from the bundle (already printable), as a terminal table:
    names as they are, no Markdown escapes."""
    return tabulate(rows, headers=headers, tablefmt="github", disable_numparse=True)


def render_show(description: dict[str, Any]) -> str:
    """The description as text: a bundle's (:func:`describe_bundle`) or a rank set's
    (:func:`parity.distributed.show.describe_rank_set`)."""
    return _render_rank_set(description) if "rank_set" in description else _render_bundle(description)


def _render_rank_set(d: dict[str, Any]) -> str:
    """A rank set as text: the set, its subject, the checksum status, a table of ranks, then one of
    the recorded outputs' placements."""
    mesh = d["mesh"]
    checksums = d["checksums"]
    lines = [
        f"parity show: rank set {printable(d['rank_set'])}",
        f"  world size {d['world_size']}, mesh {_json_line(mesh.get('shape'))} "
        f"({printable(', '.join(map(str, mesh.get('dim_names') or [])) or '?')} on "
        f"{printable(mesh.get('device_type') or '?')}), backend {printable(d['backend'])}; set id {d['set_id']}; "
        f"written by parity {printable(d.get('parity_version') or '?')} at {printable(d.get('created') or '?')}",
        _subject_line(d["subject"]),
        f"  captured with impl {printable(d.get('impl') or '?')} on {printable(d.get('device') or '?')}",
        f"  checksums ({checksums['algorithm']}): " + (
            f"verified, every tensor and shard of all {d['world_size']} ranks match" if checksums["verified"]
            else "not verified (--no-verify; python -m parity verify checks them)"),
    ]
    ranks = [[r["rank"], r["bundle"], r["tensors"], _size(r["bytes"]), r["shards"],
              "yes" if r["holds_subject"] else "no", "verified" if r["checksums_verified"] else "not verified",
              r["manifest_sha256"][:16] + "…"] for r in d["ranks"]]
    placements = [[index, printable(t["name"]), t["placement"], t["dtype"], _shape(t["shape"])]
                  for index, t in enumerate(d["placements"])]
    lines += ["", f"ranks: {len(ranks)}",
              _table(ranks, ["rank", "bundle", "tensors", "size", "shards", "inputs and state", "checksums",
                             "manifest sha256"]),
              "", f"recorded outputs, in execution order, with their placement and full shape: {len(placements)}",
              _table(placements, ["#", "name", "placement", "dtype", "full shape"])]
    return "\n".join(lines)


def _render_bundle(description: dict[str, Any]) -> str:
    """A bundle as text: a header, the platform, the checksum status, totals, then one table of
    tensors per kind (tabulate's Markdown-pasteable ``github`` format)."""

    d = description
    subject = d["subject"]
    capture = d.get("capture") or {}
    reference = capture.get("reference") or {}
    sealing = "sealed: manifest and shards checksummed" if d["sealed"] else "legacy: tensors checksummed only"
    lines = [
        f"parity show: {printable(d['bundle'])}",
        f"  {printable(d.get('bundle_format') or '?')} schema {d['schema_version']} ({sealing}); "
        f"written by parity {printable(d.get('parity_version') or '?')} at {printable(d.get('created') or '?')}",
        _subject_line(subject),
        f"  captured with impl {printable(d.get('impl') or '?')} on {printable(d.get('device') or '?')}; "
        f"layers {_json_line(capture.get('layers')) if capture.get('layers') else 'every module'}; "
        f"module inputs {'recorded' if capture.get('record_inputs') else 'not recorded'}; "
        + (f"reference {printable(reference.get('precision'))} ({printable(reference.get('dtype'))}, "
           f"impl {printable(reference.get('impl'))} on {printable(reference.get('device'))})"
           if reference else "no reference"),
    ]
    lines += _platform_lines(d.get("platform") or {})
    checksums = d["checksums"]
    if checksums["verified"]:
        lines.append(f"  checksums ({checksums['algorithm']}): verified, all {checksums['tensors']} tensors and "
                     f"{len(d['shards'])} shard{'s' if len(d['shards']) != 1 else ''} match")
    else:
        lines.append(f"  checksums ({checksums['algorithm']}): not verified (--no-verify; python -m parity verify "
                     "checks them)")
    totals = ", ".join(f"{kind.replace('_', ' ')} {t['tensors']} ({_size(t['bytes'])})"
                       for kind, t in d["totals"].items())
    lines.append(f"  totals: {len(d['tensors'])} tensors, {_size(d['total_bytes'])} in {len(d['shards'])} "
                 f"shard{'s' if len(d['shards']) != 1 else ''}: {totals or 'none'}")
    lines.append(f"  recorded outputs: {d['outputs']} ({d['layers']} module calls), "
                 f"{d['outputs_with_reference']} with a high-precision reference")
    for kind, title in (("input", "subject inputs"), ("state", "state (weights and buffers)"),
                        ("output", "recorded outputs, in execution order"), ("reference", "references"),
                        ("module_input", "module inputs (for --isolate)")):
        rows = [t for t in d["tensors"] if t["kind"] == kind]
        if not rows:
            continue
        if kind == "output":
            table = [[index, printable(t["name"]), t["dtype"], _shape(t["shape"]), t["bytes"],
                      "yes" if t["has_reference"] else "no", t["module_inputs"]] for index, t in enumerate(rows)]
            headers = ["#", "name", "dtype", "shape", "bytes", "reference", "module inputs"]
        else:
            table = [[index, printable(t["name"]), t["dtype"], _shape(t["shape"]), t["bytes"]]
                     for index, t in enumerate(rows)]
            headers = ["#", "name", "dtype", "shape", "bytes"]
        lines += ["", f"{title}: {len(rows)}", _table(table, headers)]
    return "\n".join(lines)
