"""The model zoo: Flax NNX models, each with a ``make_job(**params)`` factory that returns a
bound xshare job (``step.bind(state, data, steps=...)``) on data it generates or ships.

Entry points, as ``xshare launch`` and launch specs name them (imported lazily: importing
``models`` does not import JAX):
"""

ZOO = {
    "mlp": "models.mlp:make_job",                   # MLP classifier, synthetic teacher data
    "cnn": "models.cnn:make_job",                   # ResNet-style CNN, 32x32x3 synthetic images
    "transformer": "models.transformer:make_job",   # char-level LM on models/corpus.txt
    "inference": "models.inference:make_job",       # serving an MLP or CNN, Poisson requests
}
