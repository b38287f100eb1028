"""The offline throughput workload (issue 3's benchmark); same as `zhuzi bench offline`.

    python benchmarks/offline.py [--num-prompts 64 --no-transformers ...]
"""
import argparse

from zhuzi.bench import offline

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=offline.__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    offline.add_arguments(parser)
    offline.run(parser.parse_args())
