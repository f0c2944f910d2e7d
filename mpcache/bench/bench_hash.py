"""`mpcache-bench hash`: time core_sm's keyed prefix-chained chunk hashing (target: 8k tokens <= 20 us).

Prints one row per prompt length and implementation: chunks hashed, median and p90 microseconds
per call, and throughput in million tokens per second (a random chain key, as a server runs).
``hashlib`` is core_sm's reference path (a hashlib call per chunk); ``native`` is the server's
(runtime_zmq.sha256_chain: the whole chain in one compiled call into libcrypto, same digests,
checked here). The target applies to the server's path (native if it loads). Then the
candidate hashes for the chain, each run the same way (one call per 1 KiB chunk over the
previous digest and the chunk's packed ids), which is how the layout's hash was chosen
(``--no-candidates`` skips them). Keyed candidates start from a state that already holds the key.
The last candidate row is the floor of layout v3: SHA-256 over as many 64-byte blocks as the
chain compresses (17 per 1 KiB chunk), in one hashlib call.
"""
from __future__ import annotations

import argparse
import hashlib
import secrets
import statistics
import time
from collections.abc import Callable

from mpcache.core_sm.chunks import DEFAULT_CHUNK_SIZE, ChunkChain, TokenIds, pack_tokens

TARGET_8K_MS = 0.02


def _candidates() -> dict[str, Callable[[bytes], object] | None]:
    """Chain constructors: each maps prev||chunk to a digest the same way the chain does."""
    import xxhash

    key = secrets.token_bytes(32)
    sha_keyed = hashlib.sha256(key.ljust(64, b"\0"))
    blake2b_keyed = hashlib.blake2b(key=key, digest_size=16)
    seed = int.from_bytes(key[:8], "little")
    out: dict[str, Callable[[bytes], object] | None] = {
        "keyed sha256 (layout v3)": lambda prev: _updated(sha_keyed.copy(), prev),
        "keyed blake2b-128": lambda prev: _updated(blake2b_keyed.copy(), prev),
        "xxh3-128 (v2, unkeyed)": xxhash.xxh3_128,
        "xxh3-128 seeded (no MAC)": lambda prev: xxhash.xxh3_128(prev, seed=seed),
    }
    try:
        import blake3

        blake3_keyed = blake3.blake3(key=key)
        out["keyed blake3"] = lambda prev: _updated(blake3_keyed.copy(), prev)
    except ImportError:
        out["keyed blake3"] = None
    return out


def _updated(h: object, data: bytes) -> object:
    h.update(data)  # type: ignore[attr-defined]
    return h


def _time_chain(make: Callable[[bytes], object], packed: bytes, step: int, repeat: int) -> float:
    data = memoryview(packed)
    samples = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        prev = b"r" * 16
        for off in range(0, len(packed), step):
            h = make(prev)
            h.update(data[off : off + step])  # type: ignore[attr-defined]
            prev = h.digest()  # type: ignore[attr-defined]
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def _time_one(chain: ChunkChain, tokens: list[int] | TokenIds, chunk_size: int, root: bytes,
              repeat: int) -> list[float]:
    samples = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        chain.hashes(tokens, chunk_size, root)
        samples.append(time.perf_counter() - t0)
    return samples


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mpcache-bench hash", description=__doc__)
    parser.add_argument("--lengths", default="1024,8192,32768,131072",
                        help="comma-separated prompt lengths in tokens")
    parser.add_argument("--chunk-size", type=int, default=DEFAULT_CHUNK_SIZE)
    parser.add_argument("--repeat", type=int, default=300)
    parser.add_argument("--no-candidates", action="store_true", help="skip the candidate-hash table")
    args = parser.parse_args(argv)
    from mpcache.runtime_zmq import sha256_chain

    key = secrets.token_bytes(32)
    chains = {"hashlib": ChunkChain(key)}
    t0 = time.perf_counter()
    if sha256_chain.load():
        chains["native"] = sha256_chain.chunk_chain(key)
    print(f"native chain: {sha256_chain.status()} (load {time.perf_counter() - t0:.2f} s)")
    root = chains["hashlib"].root("bench-model", 1, "")
    lengths = [int(x) for x in args.lengths.split(",") if x]
    print(f"chunk_size={args.chunk_size} repeat={args.repeat} (token ids < 2**17, as a real vocab)")
    print("median_us: ids already packed (TokenIds, as the server hashes them); list_us: a list of ints, packing included")
    print(f"{'tokens':>8} {'chunks':>7} {'impl':>8} {'median_us':>10} {'p90_us':>9} {'Mtok/s':>8} {'list_us':>9}")
    rc = 0
    served = "native" if "native" in chains else "hashlib"
    for n in lengths:
        tokens = [(i * 7919) % 131072 for i in range(n)]
        packed = TokenIds.from_ints(tokens)
        reference = chains["hashlib"].hashes(packed, args.chunk_size, root)
        for impl, chain in chains.items():
            if chain.hashes(packed, args.chunk_size, root) != reference:  # also warms up
                raise SystemExit(f"{impl}: digests differ from hashlib's at {n} tokens")
            samples = sorted(_time_one(chain, packed, args.chunk_size, root, args.repeat))
            med = statistics.median(samples)
            p90 = samples[int(0.9 * (len(samples) - 1))]
            list_med = statistics.median(_time_one(chain, tokens, args.chunk_size, root, args.repeat))
            print(f"{n:>8} {n // args.chunk_size:>7} {impl:>8} {med * 1e6:>10.1f} {p90 * 1e6:>9.1f} "
                  f"{n / med / 1e6:>8.1f} {list_med * 1e6:>9.1f}")
            if n == 8192 and impl == served and med * 1e3 > TARGET_8K_MS:
                rc = 1
    if 8192 in lengths:
        print(f"target: 8192 tokens <= {TARGET_8K_MS * 1e3:.0f} us median ({served}) -> {'met' if rc == 0 else 'MISSED'}")
    if not args.no_candidates:
        chain_input = pack_tokens([(i * 7919) % 131072 for i in range(8192)])
        print(f"candidates, 8192 tokens, one call per {args.chunk_size}-token chunk, median of {args.repeat}:")
        for name, make in _candidates().items():
            if make is None:
                print(f"  {name:<24} not installed")
                continue
            _time_chain(make, chain_input, args.chunk_size * 4, 3)
            print(f"  {name:<24} {_time_chain(make, chain_input, args.chunk_size * 4, args.repeat) * 1e6:8.1f} us")
        # padding: 9 bytes at least (0x80 and the 64-bit length), rounded up to whole blocks
        blocks = (8192 // args.chunk_size) * -(-(16 + args.chunk_size * 4 + 9) // 64)
        floor = bytes(64 * blocks)
        samples = []
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            hashlib.sha256(floor)
            samples.append(time.perf_counter() - t0)
        print(f"  {'floor: sha256, ' + str(blocks) + ' blocks':<24} {statistics.median(samples) * 1e6:8.1f} us"
              " (one call over the blocks layout v3 compresses)")
    return rc
