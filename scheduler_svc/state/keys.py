"""Redis key names of the request state (the layout: state/store.py's docstring) and the RESP
encoding of the append script's call, which the persister sends once per step for every
running sequence and so is built by hand from cached pieces rather than through redis-py."""

from __future__ import annotations

import json

from scheduler_svc.state.leader import EPOCH_KEY
from scheduler_svc.state.records import TokenAppend

__all__ = [
    "abort_key",
    "executor_key",
    "logprobs_key",
    "pack_appends",
    "request_key",
    "tokens_key",
    "tokens_key_bulk",
]


def _bulk(data: bytes) -> bytes:
    return b"$%d\r\n%s\r\n" % (len(data), data)


# RESP bulk strings of small integers (token ids, offsets, counts), built once.
_INT_BULKS: dict[int, bytes] = {}


def _int_bulk(value: int) -> bytes:
    b = _INT_BULKS.get(value)
    if b is None:
        b = _bulk(b"%d" % value)
        if len(_INT_BULKS) < 1 << 20:
            _INT_BULKS[value] = b
    return b


def tokens_key_bulk(req_id: str, index: int) -> bytes:
    """The RESP form of a sequence's token-list key, for TokenAppend.key_bulk."""
    return _bulk(tokens_key(req_id, index).encode())


_EPOCH_KEY_BULK = _bulk(EPOCH_KEY.encode())


def pack_appends(sha: str, appends: list[TokenAppend], epoch: int = 0) -> bytes:
    """The RESP encoding of `EVALSHA sha numkeys KEYS... ARGV...` for the append script."""
    keys: list[bytes] = [_EPOCH_KEY_BULK]
    args: list[bytes] = [_int_bulk(epoch)]
    one, zero = _int_bulk(1), _int_bulk(0)
    int_bulk = _int_bulk
    cached = _INT_BULKS.get
    for a in appends:
        keys.append(a.key_bulk or tokens_key_bulk(a.req_id, a.index))
        tokens = a.token_ids
        if a.logprobs is None:
            if len(tokens) == 1:  # the common case: one decode step
                offset, token = a.offset, tokens[0]
                args.append(cached(offset) or int_bulk(offset))
                args.append(one)
                args.append(zero)
                args.append(cached(token) or int_bulk(token))
            else:
                args.extend((int_bulk(a.offset), int_bulk(len(tokens)), zero))
                args.extend(map(int_bulk, tokens))
        else:
            keys.append(_bulk(logprobs_key(a.req_id, a.index).encode()))
            args.extend((int_bulk(a.offset), int_bulk(len(tokens)), one))
            args.extend(map(int_bulk, tokens))
            args.extend(_bulk(json.dumps(lp).encode()) for lp in a.logprobs)
    head = b"*%d\r\n$7\r\nEVALSHA\r\n%s%s" % (
        3 + len(keys) + len(args),
        _bulk(sha.encode()),
        int_bulk(len(keys)),
    )
    return b"".join((head, *keys, *args))


def executor_key(instance_id: str) -> str:
    return f"llmserve:executor:{instance_id}"


def request_key(req_id: str) -> str:
    return f"llmserve:request:{req_id}"


def abort_key(req_id: str) -> str:
    return f"llmserve:abort:{req_id}"


def tokens_key(req_id: str, index: int) -> str:
    return f"llmserve:tokens:{req_id}:{index}"


def logprobs_key(req_id: str, index: int) -> str:
    return f"llmserve:logprobs:{req_id}:{index}"
