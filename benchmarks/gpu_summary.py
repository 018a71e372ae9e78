"""The GPU results of one session in one file, against issue 34's goals: ``results/gpu.json``.

Why: the three GPU benchmarks (``kernels_gpu.py``, ``load_stall_gpu.py``, ``transfer_gpu.py``)
each write their own records; this reads them and writes what each goal asks, with the device,
the commands and the files the numbers come from, so that a reader sees what was measured on
which GPU and what fell short. ``gpu_session.sh`` runs it last.

    python -m benchmarks.gpu_summary OUT            # reads OUT/*_gpu.json, writes OUT/gpu.json
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Annotated, Any

import typer

from benchmarks.common import LOG_FORMAT, write_json

logger = logging.getLogger(__name__)

FILES = ("kernels_gpu.json", "load_stall_gpu.json", "transfer_gpu.json")
COPY_GOAL = 0.8  # gather and scatter / a device copy, 1 MiB and 32 MiB chunks
STALL_GOAL_S = 1e-3  # what an 8k-token load may add to the model's step


def summarise(kernels: dict, stall: dict, transfer: dict) -> dict[str, Any]:
    """Each goal's measured values and whether they meet it."""
    ratios: dict[str, dict[str, float]] = {}
    for record in kernels["records"]:
        if record.get("default_launch"):
            op = f"{record['op']}_{record['bytes'] >> 20}MiB"
            ratios.setdefault(op, {})[record["layout"]] = round(record["ratio_vs_memcpy"], 3)
    copies = {op: by_layout for op, by_layout in ratios.items() if "load" not in op}
    stalls = {
        f"{r['buffer']}{'' if r['model_waits'] else '_async'}": round(r["added_s"] * 1e3, 2)
        for r in stall["records"]
    }
    transfers = {
        f"{r['buffer_device']}_{r['tokens']}": {
            "gbps": round(r["gbps"], 2),
            "pinned_copy_gbps": round(r["pinned_copy_gbps"], 2),
            "bit_exact": r["bit_exact"],
        }
        for r in transfer["records"]
    }
    async_ms = [ms for name, ms in stalls.items() if name.endswith("_async")]
    return {
        "device": kernels["device"],
        "date": kernels["date"],
        "copies_vs_device_copy": {
            "goal": COPY_GOAL,
            "met": all(v >= COPY_GOAL for by_layout in copies.values() for v in by_layout.values()),
            "default_launch": ratios,
        },
        "load_added_to_step_ms": {
            "goal": STALL_GOAL_S * 1e3,
            "met": all(ms <= STALL_GOAL_S * 1e3 for ms in async_ms),
            "by_buffer": stalls,
        },
        "transfer": {"all_bit_exact": all(t["bit_exact"] for t in transfers.values()), **transfers},
        "sources": {
            name: doc["command"]
            for name, doc in zip(FILES, (kernels, stall, transfer), strict=True)
        },
    }


app = typer.Typer(add_completion=False, help=__doc__.splitlines()[0])


@app.command()
def main(
    folder: Annotated[Path, typer.Argument(help="where the GPU benchmarks wrote their JSON")],
) -> None:
    """Read the three files, write ``gpu.json`` beside them."""
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)
    documents = [json.loads((folder / name).read_text()) for name in FILES]
    summary = summarise(*documents)
    write_json(folder / "gpu.json", summary)
    logger.info("wrote %s: %s", folder / "gpu.json", json.dumps(summary["copies_vs_device_copy"]))


if __name__ == "__main__":
    app()
