"""Serving: models deployed next to training jobs (``xshare.model``, ``Runtime.deploy``) and the
Open Inference Protocol over the runtime's HTTP server (:mod:`.oip`)."""
