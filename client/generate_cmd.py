"""`halfmoon generate`: --local runs the single-process reference, otherwise a running cluster
answers."""

from __future__ import annotations

import argparse


def run(args: argparse.Namespace) -> int:
    if args.local:
        from client.local import generate_local

        return generate_local(args)
    from client.remote import generate_remote

    return generate_remote(args)
