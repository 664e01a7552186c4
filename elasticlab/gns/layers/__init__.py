"""Per-layer rules, one module per layer family, each registering itself in :mod:`elasticlab.gns.registry`.

- :mod:`.linear`: ``nn.Linear`` (2-D inputs: product of norms; sequences: Gram or outer-product form).
- :mod:`.conv`: ``nn.Conv1d`` / ``nn.Conv2d`` (a Linear over the unfolded input).
- :mod:`.conv_nd`: ``nn.Conv3d`` and the transposed convolutions (one grouped convolution's weight gradient).
- :mod:`.layernorm` (Gray et al. 2024), :mod:`.groupnorm`, :mod:`.rmsnorm`, :mod:`.batchnorm` (eval mode
  only), :mod:`.instancenorm`: the normalisation layers' affine parameters.
- :mod:`.prelu`: ``nn.PReLU``'s slopes; :mod:`.bilinear`: ``nn.Bilinear`` (three Grams over the positions).
- :mod:`.embedding`: ``nn.Embedding`` (rows of an example sharing an index add up first).
- :mod:`.embedding_bag`: ``nn.EmbeddingBag`` (each bag an example; sum, mean and max modes).
- :mod:`.attention`: ``nn.MultiheadAttention`` (its bare in-projection and its ``out_proj``).
- :mod:`.recurrent`: ``nn.RNN`` / ``nn.LSTM`` / ``nn.GRU`` (a loop over time exposing the pre-activations).
- :mod:`.cells`: ``nn.RNNCell`` / ``nn.LSTMCell`` / ``nn.GRUCell`` (their two affine maps; a cell called at
  each step of a loop is summed over the steps, :mod:`elasticlab.gns.repeated`).
- :mod:`.broadcast_params`: bare parameters of a module with children broadcast over the batch (a ViT's
  class token and position embedding), followed to their broadcast; its taps, which take the per-example
  gradients there, are :mod:`.broadcast_taps` (no rule of its own).
- :mod:`.bias_method`: T5's relative position bias, looked up over the batch at its
  attention's ``compute_bias`` (no rule of its own: the embedding rule reads the lookup).
- :mod:`.parametrized`: the originals of a parametrized tensor (weight_norm: wav2vec 2.0's positional
  convolution), by torch.func on the calls of the layer that owns them.
- :mod:`.generic`: the fallback for leaf modules of no registered type (HF's RMSNorm classes): per-example
  gradients by torch.func, for layers that treat each example alone (checked once per input shape).
Importing this package registers them all.
"""
from elasticlab.gns.layers import (  # noqa: F401  (each module registers its rule on import)
    attention,
    batchnorm,
    bilinear,
    broadcast_params,
    cells,
    conv,
    conv_nd,
    embedding,
    embedding_bag,
    generic,
    groupnorm,
    instancenorm,
    layernorm,
    linear,
    parametrized,
    prelu,
    recurrent,
    rmsnorm,
)
