"""The model zoo, installed as ``xshare.models`` (this folder of the repository; there is no
top-level ``models`` package once installed): Flax NNX models, each with a ``make_job(**params)``
factory that returns a bound xshare job (``step.bind(state, data, steps=...)``) on data it
generates or ships.

Entry points, as ``xshare launch`` and launch specs name them (imported lazily: importing
``xshare.models`` does not import JAX). The old spelling ``models.mlp:make_job`` still works
from a checkout, and resolves to ``xshare.models`` elsewhere with a deprecation warning.
"""

ZOO = {
    "mlp": "xshare.models.mlp:make_job",                  # MLP classifier, synthetic teacher data
    "cnn": "xshare.models.cnn:make_job",                  # ResNet-style CNN, 32x32x3 synthetic images
    "transformer": "xshare.models.transformer:make_job",  # char-level LM on corpus.txt
    "inference": "xshare.models.inference:make_job",      # serving an MLP or CNN, Poisson requests
}
