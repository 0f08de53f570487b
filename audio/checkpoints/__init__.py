"""Readers of the pretrained weight files the speech models load (`model.weights=PATH`).

One module per source format: `openai_whisper` (OpenAI's Whisper .pt), `hf` (Hugging Face folders),
`ctranslate2` (CTranslate2's model.bin), `fairseq` (fairseq and microsoft/unilm checkpoints) and
`torchaudio_layout` (torchaudio's wav2vec2-family keys, which the others are mapped onto). Per model family
one step finds a file's format and loads it into a model already built plainly from its sizes:
`whisper_files`, `encoder_files` (wav2vec 2.0, HuBERT, WavLM); `audio.pretrained` chains the two as the
registered builders.

Nothing read from a file runs: torch files are read with weights_only=True, safetensors and JSON as data,
CTranslate2's binary as plain arrays, fairseq's conv-layer expression as literals only.
"""
