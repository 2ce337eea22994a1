"""The main demonstration: every lesson at 2 ranks on CPU, then one table.

    make demo                       # or: .venv/bin/python -m scripts.learn.demo --nproc 2
    .venv/bin/python -m scripts.learn.demo --precision bf16 --steps 20
"""
import argparse
import statistics

from scripts.runs import available_lessons, launch, mib


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--steps", type=int, default=40)
    a = p.parse_args()
    rows = []
    for lesson in available_lessons():
        print(f"\n=== {lesson}: torchrun --nproc_per_node={a.nproc} {lesson}.py "
              f"--precision {a.precision} --steps {a.steps}", flush=True)
        r = launch(lesson, a.nproc, ["--precision", a.precision, "--steps", a.steps], echo=True)
        m, th = r["memory"]["per_rank"][0], r["memory"]["theory"]
        held = m["params"] + m["grads"] + m["optimizer"]
        rows.append((lesson, r["losses"][-1], 1e3 * statistics.median(r["step_time_s"]),
                     mib(r["comm"]["issued_ring_bytes_per_step"]), mib(r["comm"]["theory_ring_bytes_per_step"]),
                     mib(held), mib(th["total"]), mib(m["peak_params"])))
    print(f"\n{a.nproc} ranks, {a.precision}, {a.steps} steps; bytes per rank (MiB); "
          "issued = per optimizer step, the payloads the collectives asked for x ring factor (a count); "
          "held = params + grads + optimizer state at rest (measured)")
    header = f"{'lesson':<20} {'final loss':>10} {'step ms':>8} {'issued':>7} {'theory':>7} " \
             f"{'held':>7} {'theory':>7} {'peak params':>11}"
    print(header + "\n" + "-" * len(header))
    for row in rows:
        print(f"{row[0]:<20} {row[1]:>10.4f} {row[2]:>8.1f} {row[3]:>7.2f} {row[4]:>7.2f} "
              f"{row[5]:>7.2f} {row[6]:>7.2f} {row[7]:>11.2f}")


if __name__ == "__main__":
    main()
