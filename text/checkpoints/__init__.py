"""Readers and writers of the pretrained weight formats the text models load (`model.weights=PATH`).

One module per source format: `hf` (Hugging Face Llama, Qwen2 and Qwen3 folders, safetensors only).
`text.pretrained` chains reading a folder's sizes, building the plain model and loading its tensors.
"""
