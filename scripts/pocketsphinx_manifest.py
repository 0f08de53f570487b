"""Write a JSONL manifest of the real recorded English speech in Debian's pocketsphinx-testdata package.

    apt-get install pocketsphinx-testdata      # or: apt-get download it and dpkg -x it into a folder
    python scripts/pocketsphinx_manifest.py --out /tmp/real.jsonl [--root /usr/share/pocketsphinx/test/data]
    python -m recipes.eval ckpt=RUN data.name=manifest data.train=/tmp/real.jsonl data.val=/tmp/real.jsonl \
        task.decoder=greedy

The package (BSD-style, CMU Sphinx's test data) holds 10 human recordings with transcripts, 16 kHz mono WAV:
five LibriVox readings from Sense and Sensibility (librivox/, read speech, 2-7 s) and five card names spoken
to CMU's "cards" grammar (cards/). Too few to train on; enough to see whether a model hears people at all.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

DEFAULT_ROOT = Path("/usr/share/pocketsphinx/test/data")
#: the two folders with a Sphinx transcription file: "<s> words </s> (utterance id)" per line
SETS = {"librivox": "transcription", "cards": "cards.transcription"}
LINE = re.compile(r"^<s>\s*(?P<text>.*?)\s*</s>\s*\((?P<id>[^)]+)\)\s*$")


def rows(root: Path) -> list[dict[str, str]]:
    """One manifest row per transcribed recording under `root`: audio_filepath (absolute) and text."""
    out = []
    for folder, name in SETS.items():
        for line in (root / folder / name).read_text().splitlines():
            m = LINE.match(line)
            if m is None:
                continue
            wav = root / folder / f"{m['id']}.wav"
            if wav.is_file():
                out.append({"audio_filepath": str(wav.resolve()), "text": " ".join(m["text"].split())})
    return out


def main() -> int:
    """Write the manifest; exit 2 with one line when the package's folder is not there."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", type=Path, default=DEFAULT_ROOT, help="the package's test/data folder")
    parser.add_argument("--out", type=Path, required=True, help="the JSONL manifest to write")
    args = parser.parse_args()
    if not all((args.root / f / n).is_file() for f, n in SETS.items()):
        print(
            f"error: --root={args.root} has no librivox/ and cards/ transcriptions; "
            "apt-get install pocketsphinx-testdata (or give the folder it unpacks to)",
            file=sys.stderr,
        )
        return 2
    found = rows(args.root)
    args.out.write_text("".join(json.dumps(r) + "\n" for r in found))
    print(f"{args.out}: {len(found)} recordings")
    return 0


if __name__ == "__main__":
    sys.exit(main())
