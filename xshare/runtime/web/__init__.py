"""The runtime's servers: HTTP (``http_app``, ``server``: status, metrics, controls, ``/v2``
inference), gRPC (``grpc_server``), and the discovery files ``xshare top`` finds them by."""
