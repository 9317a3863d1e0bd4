"""Streaming data: raw text read, tokenized and packed on the fly (data.stream), nothing written.

The pieces, from the bottom up (one module each):

    sources   what data.stream names: weighted sources, each a list of files (.jsonl,
              .jsonl.gz, .parquet, .txt) or a Hugging Face dataset; reading documents from a
              position
    shards    a fixed number of logical shards per source, each with its own cursor: which
              documents a shard reads in an epoch (the epoch's shuffle), from a saved state
    packing   documents + end-of-document tokens cut into seq_length + 1 windows, with the
              carry-over that crosses into the next window
    mixture   which source the next sample comes from: a weighted round robin over tokens
    stream    the global stream: samples from the shards in a fixed order, its state (per
              shard: file, offset, carry; per source: epoch; the mixture's counts)
    pool      loader processes that tokenize shards in parallel, preserving that order
    dataset   what the trainer holds: samples by index, the saved state, validation samples

The global sample order depends only on the sources, weights, seed and seq_length: not on the
data-parallel size, the micro-batch size or the number of loader processes.
"""
