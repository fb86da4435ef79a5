"""What the one-call GPU scripts (bench/gpu_*.py) share: the device's name, and their figures
written as <kind>-<device>-<date>.json and .md under bench/results/ (or --out)."""
from __future__ import annotations

import datetime
import json
import os
import re
from pathlib import Path

import torch


def device_name() -> str:
    if torch.cuda.is_available():
        return torch.cuda.get_device_name()
    return f"cpu ({os.cpu_count()} cores)"


def today() -> str:
    return datetime.date.today().isoformat()


def write_results(kind: str, result: dict, markdown: str, out_dir) -> tuple[Path, Path]:
    """result must hold "device" and "date"; returns the paths of the .json and .md written."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"{kind}-{re.sub(r'[^A-Za-z0-9]+', '-', result['device']).strip('-').lower()}-{result['date']}"
    json_path, md_path = out / f"{stem}.json", out / f"{stem}.md"
    json_path.write_text(json.dumps(result, indent=2) + "\n")
    md_path.write_text(markdown)
    return json_path, md_path


def write_table(kind: str, markdown: str, out_file=None) -> Path:
    """A one-table script's markdown, printed and written to out_file, by default
    bench/results/<kind>-<device>-<date>.md; returns the path written."""
    print(markdown)
    slug = re.sub(r"[^A-Za-z0-9]+", "-", device_name()).strip("-").lower()
    path = Path(out_file) if out_file else Path(__file__).resolve().parent / "results" / f"{kind}-{slug}-{today()}.md"
    path.write_text(markdown)
    return path
