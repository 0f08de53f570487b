"""scripts/pocketsphinx_manifest.py: Debian's pocketsphinx-testdata transcriptions as a JSONL manifest that
data=manifest reads, built here from a tree in the package's layout; a missing folder is exit 2."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import soundfile as sf
import torch

from audio.datasets import read_manifest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "pocketsphinx_manifest.py"


def _package_tree(root: Path) -> None:
    """librivox/ and cards/ as the package lays them out: a Sphinx transcription and 16 kHz WAVs."""
    layout = {
        "librivox": ("transcription", {"a-0870": "he was not an ill disposed young man"}),
        "cards": ("cards.transcription", {"001": "ten of clubs", "002": "five five"}),
    }
    for folder, (name, texts) in layout.items():
        (root / folder).mkdir(parents=True)
        lines = [f"<s> {text}  </s> ({uid})" for uid, text in texts.items()]
        lines.append("<s> a line without its recording </s> (missing)")
        (root / folder / name).write_text("\n".join(lines) + "\n")
        for uid in texts:
            sf.write(root / folder / f"{uid}.wav", (0.1 * torch.randn(16_000)).numpy(), 16_000)


def test_the_manifest_lists_each_transcribed_recording_once(tmp_path: Path) -> None:
    _package_tree(tmp_path / "data")
    out = tmp_path / "real.jsonl"
    r = subprocess.run(
        [sys.executable, str(SCRIPT), "--root", str(tmp_path / "data"), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    got = [json.loads(line) for line in out.read_text().splitlines()]
    want = ["he was not an ill disposed young man", "ten of clubs", "five five"]
    assert [row["text"] for row in got] == want
    assert all(Path(row["audio_filepath"]).is_file() for row in got)
    clips = read_manifest(out)
    assert [c.text for c in clips] == [row["text"] for row in got]


def test_a_missing_package_folder_is_one_line_and_exit_2(tmp_path: Path) -> None:
    r = subprocess.run(
        [sys.executable, str(SCRIPT), "--root", str(tmp_path), "--out", str(tmp_path / "x.jsonl")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and not (tmp_path / "x.jsonl").exists()
