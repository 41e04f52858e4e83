"""Repeat one GPU accuracy check N times with fresh random inputs and count how often it misses the error rule
(python -m bench.flake_check [N]). Used to tell a rare tolerance miss from a kernel bug."""
import sys

sys.path.insert(0, "tests")


def main(n=40):
    from test_flash_bwd import check_grads

    cases = [("kv", 32), ("kv", 64), ("2d", 32), ("2d", 64), ("q", 32)]
    for part, d in cases:
        fails, worst = 0, ""
        for _ in range(n):
            try:
                check_grads(2, 300, 17, 2, 2, d, "float16", True, warp_partition=part)
            except AssertionError as e:
                fails += 1
                worst = str(e).splitlines()[0][:160]
        print(f"flake_check (300, 17) causal fp16 d={d} {part}: {fails}/{n} missed  {worst}", flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 40)
