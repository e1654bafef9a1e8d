"""The portable scalar build of the key kernel gives the same keys as the native op (SIMD here)."""

from __future__ import annotations

import random
import shutil
import subprocess
from pathlib import Path

import pytest

from kvci_plugin import ops

REPO_ROOT = Path(__file__).resolve().parents[2]
COMPILER = shutil.which("g++") or shutil.which("c++")

# Reads: n_cases, then per case: block_size n_tokens k0 k1 k2 k3 tokens...; prints keys as hex.
DRIVER = r"""
#include <cinttypes>
#include <cstdio>
#include <vector>
#include "cpu/block_keys.h"

int main() {
  int64_t cases = 0;
  if (std::scanf("%" SCNd64, &cases) != 1) return 1;
  for (int64_t c = 0; c < cases; ++c) {
    int64_t bs = 0, n = 0;
    uint64_t k[4];
    if (std::scanf("%" SCNd64 " %" SCNd64 " %" SCNu64 " %" SCNu64 " %" SCNu64 " %" SCNu64,
                   &bs, &n, &k[0], &k[1], &k[2], &k[3]) != 6) return 1;
    std::vector<uint32_t> tokens(n);
    for (auto& t : tokens) {
      if (std::scanf("%" SCNu32, &t) != 1) return 1;
    }
    const int64_t blocks = n / bs;
    std::vector<uint64_t> scratch(6 * blocks + 1), out(2 * blocks + 1);
    const kvci::keys::ChainBuffers buf{scratch.data(), scratch.data() + blocks,
                                       scratch.data() + 2 * blocks, scratch.data() + 3 * blocks,
                                       scratch.data() + 4 * blocks, scratch.data() + 5 * blocks};
    kvci::keys::prefix_keys(tokens.data(), blocks, bs, {k[0], k[1]}, {k[2], k[3]}, buf,
                            out.data());
    for (int64_t i = 0; i < blocks; ++i) {
      for (int half = 0; half < 2; ++half) {
        for (int byte = 0; byte < 8; ++byte) {
          std::printf("%02x", unsigned((out[2 * i + half] >> (8 * byte)) & 0xff));
        }
      }
      std::printf(" ");
    }
    std::printf("\n");
  }
  return 0;
}
"""


@pytest.fixture(scope="module")
def portable_binary(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if COMPILER is None:
        pytest.skip("no C++ compiler to build the portable kernel with")
    folder = tmp_path_factory.mktemp("portable")
    (folder / "driver.cpp").write_text(DRIVER)
    binary = folder / "driver"
    subprocess.run(
        [
            COMPILER,
            "-O2",
            "-std=c++17",
            "-DKVCI_PORTABLE",
            f"-I{REPO_ROOT / 'csrc'}",
            str(folder / "driver.cpp"),
            str(REPO_ROOT / "csrc" / "cpu" / "block_keys.cpp"),
            "-o",
            str(binary),
        ],
        check=True,
    )
    return binary


def test_portable_kernel_matches_native_op(portable_binary: Path) -> None:
    rng = random.Random(11)
    namespace, secret = b"n" * 32, b"s" * 32
    cases = []
    for block_size in (1, 2, 3, 7, 8, 9, 16, 17, 32, 33):
        for n_blocks in (0, 1, 4, 7, 8, 9, 16, 17, 25, 100):
            tokens = [rng.randrange(2**31) for _ in range(block_size * n_blocks + rng.randrange(3))]
            tenant = f"tenant{len(cases)}"
            derived = ops.derive_subkeys(namespace, tenant, secret)
            words = [int.from_bytes(derived[i : i + 8], "little") for i in range(0, 32, 8)]
            cases.append((block_size, tokens, tenant, words))
    stdin = [str(len(cases))]
    for block_size, tokens, _, words in cases:
        stdin.append(" ".join(map(str, [block_size, len(tokens), *words, *tokens])))
    result = subprocess.run(
        [str(portable_binary)], input="\n".join(stdin), capture_output=True, text=True, check=True
    )
    lines = result.stdout.splitlines()
    for (block_size, tokens, tenant, _), line in zip(cases, lines, strict=True):
        native = ops.key_bytes(ops.prefix_block_keys(tokens, block_size, namespace, tenant, secret))
        assert line.split() == [key.hex() for key in native]
