"""xshare as a service (``xshare serve`` / ``submit`` / ``ctl``) and across many devices (Ray).

:mod:`xshare.jobs` describes jobs as plain data (pure Python; :mod:`.jobs` re-exports it);
:mod:`.client` talks to a running service (stdlib HTTP); :mod:`.service` is the long-lived runtime behind ``xshare serve``;
:mod:`.ray` holds the runtime actors and the sweep driver (needs ``xshare[ray]``). Importing
this package imports none of them.
"""
