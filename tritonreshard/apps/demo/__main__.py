"""``python -m tritonreshard.apps.demo [options]``: the demo without the ``tritonreshard`` command."""
import argparse
import sys

import tritonreshard.apps.demo as demo


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tritonreshard.apps.demo",
                                     description=demo.__doc__.splitlines()[0])
    demo.add_arguments(parser)
    return demo.run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
