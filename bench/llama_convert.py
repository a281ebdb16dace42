#!/usr/bin/env python3
"""llama.cpp's convert_hf_to_gguf.py, run unmodified from LLAMA_CPP_DIR, on a checkpoint whose
tokenizer it does not know by its hash: the pre-tokenizer is declared `qwen2` (the regex the
fixtures' tokenizer was trained with), as testdata/make_gguf_fixtures.py does. Arguments are the
converter's.

Usage: LLAMA_CPP_DIR=... bench/llama_convert.py MODEL_DIR --outtype bf16 --outfile OUT.gguf
"""
import os
import runpy
import sys

src = os.environ["LLAMA_CPP_DIR"]
sys.path[:0] = [src, os.path.join(src, "gguf-py")]
import conversion.base as base  # noqa: E402

base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "qwen2"
sys.argv = [os.path.join(src, "convert_hf_to_gguf.py")] + sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
