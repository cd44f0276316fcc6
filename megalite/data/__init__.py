"""Data: tokenizers, Megatron's indexed datasets, the GPT dataset, blending, DP-aware loaders.

Entry points: ``config.DataConfig`` (the data flags), ``tokenizers.build_tokenizer`` and
``builders.build_data_loaders``. Files: ``tokenizer_base`` (the interface) and one module per
tokenizer (``null_tokenizer``, ``sentencepiece_tokenizer``, ``hf_tokenizer``, ``gpt2_bpe``,
``tiktoken_tokenizer``; ``bpe`` the merges they share), ``indexed_dataset`` (.bin/.idx),
``gpt_dataset`` (+ ``index_builders``, ``index_cache``, ``cache_dirs``: where caches live),
``vocab_check`` (token ids fit the vocabulary), ``blended_dataset``, ``mock_dataset``,
``samplers``; ``preprocess`` and ``tokenizer_training`` do the work of tools/preprocess_data.py
and tools/train_tokenizer.py.
"""
