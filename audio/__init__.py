"""torchkiln audio: speech datasets, Conformer-CTC and the ASR task (registered on import).

eSpeak NG (for the embedded corpus) is never imported here; `audio.corpus` runs it in a subprocess.
"""

from audio import asr, conformer, corpus, ctc, datasets, features

__all__ = ["asr", "conformer", "corpus", "ctc", "datasets", "features"]
