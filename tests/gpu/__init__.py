"""Tests that need a CUDA GPU (and the vLLM extra); skipped elsewhere."""
