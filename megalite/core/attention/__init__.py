"""Attention masks as block masks (``masks``), block-sparse layouts (``sparse_layouts``) and the
attention that computes only the blocks a mask keeps (``block_sparse``; a plain causal window by
tiles: ``band_attention``)."""
