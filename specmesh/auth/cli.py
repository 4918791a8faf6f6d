"""`specmesh keys ...` (and `specmesh admin ...`, from specmesh/admin_cli.py), and the client options every gateway call shares
(--api-key / $SPECMESH_API_KEY, --ca-file / --cert-file / --key-file for TLS)."""

from __future__ import annotations

import argparse
import json
import os
import sys


# ---------------------------------------------------------------------------- client options

def add_client_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--api-key", default=None, help="API key (default $SPECMESH_API_KEY); sent as a Bearer token")
    p.add_argument("--ca-file", help="TLS: trust this CA (PEM) for the gateway's certificate")
    p.add_argument("--cert-file", help="TLS: client certificate (PEM), when the gateway requires one")
    p.add_argument("--key-file", help="TLS: client private key (PEM)")
    p.add_argument("--server-name", help="TLS: expect this name in the gateway's certificate")


def client_channel(args):
    """A channel to args.target: TLS when --ca-file (or a client certificate) is given."""
    from specmesh.rpc.client_tls import ClientTls

    return ClientTls(args.ca_file, args.cert_file, args.key_file, args.server_name).channel(args.target)


def call_metadata(args) -> list[tuple[str, str]]:
    key = args.api_key or os.environ.get("SPECMESH_API_KEY")
    return [("authorization", f"Bearer {key}")] if key else []


# ---------------------------------------------------------------------------- keys

def _store(args):
    from specmesh.auth.store import KeyStore, connect, redis_url
    from specmesh.config import load_config

    cfg = load_config(args.config)
    url = args.redis_url or redis_url(cfg.auth)
    return KeyStore(connect(url, max(cfg.auth.redis_timeout_s, 2.0)), cfg.auth.key_prefix)


def _cmd_keys(args) -> int:
    import redis

    try:
        store = _store(args)
        if args.keys_command == "create":
            key, rec = store.create(args.name, args.rpm, args.tpm, args.admin)
            print(key)  # shown once; only its SHA-256 is stored
            print(f"created key {rec.name!r} (id {rec.id}, rpm {rec.rpm or 'unlimited'}, tpm {rec.tpm or 'unlimited'}"
                  f"{', admin' if rec.admin else ''}); store it now: it cannot be shown again", file=sys.stderr)
        elif args.keys_command == "list":
            records = [r.public() for r in store.list()]
            if args.json:
                print(json.dumps(records))
            for r in records if not args.json else ():
                state = "revoked" if r["revoked"] else "active"
                print(f"{r['id']}  {r['name']:<24} rpm={r['rpm'] or '-':<6} tpm={r['tpm'] or '-':<8} "
                      f"{'admin ' if r['admin'] else ''}{state}")
        else:
            rec = store.revoke(args.name_or_id)
            print(f"revoked key {rec.name!r} (id {rec.id})")
    except (ValueError, KeyError) as exc:
        print(f"specmesh keys: {exc}", file=sys.stderr)
        return 1
    except redis.RedisError as exc:
        print(f"specmesh keys: redis unreachable: {exc}", file=sys.stderr)
        return 1
    return 0


def add_commands(sub, default_target: str) -> None:
    p = sub.add_parser("keys", help="API keys: create, list, revoke (Redis at $SPECMESH_REDIS_URL)")
    p.add_argument("--config")
    p.add_argument("--redis-url", help="default: auth.redis_url, $SPECMESH_REDIS_URL, redis://127.0.0.1:6379/0")
    ks = p.add_subparsers(dest="keys_command", required=True)
    c = ks.add_parser("create", help="print a new key once (only its SHA-256 is stored)")
    c.add_argument("--name", required=True)
    c.add_argument("--rpm", type=int, default=0, help="requests per minute (0 = unlimited)")
    c.add_argument("--tpm", type=int, default=0, help="tokens per minute, prompt + max_tokens (0 = unlimited)")
    c.add_argument("--admin", action="store_true", help="may call the Admin service")
    c = ks.add_parser("list", help="every key: id, name, limits, state (never the key)")
    c.add_argument("--json", action="store_true")
    c = ks.add_parser("revoke", help="revoke a key by name or id")
    c.add_argument("name_or_id")
    p.set_defaults(fn=_cmd_keys)

    from specmesh.admin_cli import add_admin_commands

    add_admin_commands(sub, default_target)  # admin speculation, admin canary
