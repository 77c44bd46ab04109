"""Benchmarks: stargrpc against bare grpc.aio on the same machine, in the same run.

Run ``python -m bench`` (see ``bench/README.md``). Never imported by the server.
"""
