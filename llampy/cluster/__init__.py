"""llampy on a Ray cluster: replicas behind one ingress with a prefix-aware router and failover (Ray Serve), and a
model's layers split over nodes (stage actors holding a remote backend's memory). Needs the ``ray`` extra; nothing
else in llampy imports Ray.

    from llampy.cluster import deploy
    d = deploy("smollm2", replicas=2, parallel=4, router="prefix", address="local:2")
    print(d.url)        # an OpenAI-compatible server, as `llampy serve`'s
"""
from __future__ import annotations


def deploy(model=None, **kw):
    from .launch import deploy as _deploy
    return _deploy(model, **kw)


__all__ = ["deploy"]
