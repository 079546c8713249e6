"""Is a checkpoint's save and load bound by the disk?

fsdp-train saves a model's state once (weights, AdamW's moments: `--save-every 1`) and resumes from
it; then `dd` reads the checkpoint's files (one reader a file) and writes as many bytes from as
many processes as there are ranks, each file synced (`conv=fdatasync`, as the checkpoint's files
are). Where the kernel lets it (root), the page cache is dropped before each read, so both reads
come from the disk. Prints a progress line per phase and a summary; one JSON line to --out.

    python3 bench/checkpoint_speed.py --out /tmp/ckspeed --model small --seq 64 --batch 1   # CPU ranks
    python3 bench/checkpoint_speed.py --out /tmp/ckspeed --gpu --model 8b --disk-gb 24       # GPUs

--disk-gb measures the disk on that many bytes instead of the whole checkpoint's: the 8B's 96 GB
saved, loaded, and then read and written again by `dd` take longer than one ten-minute device
call.
"""
import argparse
import json
import math
import os
import re
import shutil
import subprocess
import time


def timed(commands):
    """Runs the commands side by side; their wall time in seconds."""
    start = time.perf_counter()
    running = [subprocess.Popen(c, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for c in commands]
    if any(p.wait() != 0 for p in running):
        raise SystemExit(f"checkpoint_speed: failed: {commands}")
    return time.perf_counter() - start


def drop_page_cache():
    """True where the page cache could be dropped (then reads come from the disk)."""
    subprocess.run(["sync"], check=True)
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def train(args, *flags):
    cmd = [f"{args.build}/fsdp-run", "--gpu" if args.gpu else "--cpu", "-n", str(args.ranks),
           f"{args.build}/fsdp-train", "--model", args.model, "--seq", str(args.seq), "--batch", str(args.batch),
           "--param-dtype", "bf16", *flags]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"checkpoint_speed: {' '.join(cmd)} failed:\n{(done.stdout + done.stderr)[-3000:]}")
    return done.stdout


def seconds(pattern, output):
    m = re.search(pattern, output)
    if not m:
        raise SystemExit(f"checkpoint_speed: no '{pattern}' in fsdp-train's output:\n{output[-2000:]}")
    return float(m.group(1))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="a new folder on the disk to measure")
    p.add_argument("--build", default="build")
    p.add_argument("--gpu", action="store_true", help="GPU ranks (default CPU ranks)")
    p.add_argument("--ranks", type=int, help="default: 2 CPU ranks, or every GPU")
    p.add_argument("--disk-gb", type=float, help="the disk's speed from this many GB (default: the checkpoint's size)")
    p.add_argument("--model", default="small")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--batch", type=int, default=1)
    args = p.parse_args()
    if args.ranks is None:
        args.ranks = len(subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True,
                                        check=True).stdout.splitlines()) if args.gpu else 2
    if os.path.exists(args.out):
        p.error(f"--out {args.out} exists: give a new folder (it is filled and emptied)")
    os.makedirs(args.out)
    began = time.perf_counter()

    def progress(what):  # a line per phase: a run stopped by a time limit still says how far it got
        print(f"checkpoint_speed: {what} ({time.perf_counter() - began:.0f} s in)", flush=True)

    saved = train(args, "--steps", "1", "--save-every", "1", "--save-dir", f"{args.out}/run")
    save_s = seconds(r"saved \S+ in ([\d.]+) s", saved)
    step = f"{args.out}/run/step-000001"
    files = sorted(f"{step}/{n}" for n in os.listdir(step))
    size = sum(os.path.getsize(f) for f in files)
    progress(f"saved {size / 1e9:.2f} GB in {save_s:.2f} s")
    cold = drop_page_cache()
    resumed = train(args, "--steps", "2", "--resume", step, "--save-dir", f"{args.out}/resumed")
    load_s = seconds(r"resumed from \S+ .* in ([\d.]+) s", resumed)
    shutil.rmtree(f"{args.out}/resumed")
    progress(f"loaded in {load_s:.2f} s")
    drop_page_cache()
    # The disk on the same files (or their first --disk-gb), one reader and then one writer a rank.
    sample = min(size, int(args.disk_gb * 1e9)) if args.disk_gb else size
    blocks = math.ceil(sample / args.ranks / (64 << 20))
    read = sum(min(os.path.getsize(f), blocks * (64 << 20)) for f in files)
    read_s = timed([["dd", f"if={f}", "of=/dev/null", "bs=64M", f"count={blocks}"] for f in files])
    progress(f"read {read / 1e9:.2f} GB by dd in {read_s:.2f} s")
    write_s = timed([["dd", "if=/dev/zero", f"of={args.out}/dd-{r}", "bs=64M", f"count={blocks}", "conv=fdatasync"]
                     for r in range(args.ranks)])
    written = args.ranks * blocks * (64 << 20)
    progress(f"written {written / 1e9:.2f} GB by dd in {write_s:.2f} s")
    shutil.rmtree(args.out + "/run")
    for r in range(args.ranks):
        os.remove(f"{args.out}/dd-{r}")
    row = dict(model=args.model, ranks=args.ranks, gpu=args.gpu, bytes=size, save_s=save_s, disk_write_s=write_s,
               disk_write_gb_s=written / write_s / 1e9, load_s=load_s, disk_read_s=read_s, disk_read_bytes=read, cold_reads=cold,
               save_gb_s=size / save_s / 1e9, load_gb_s=size / load_s / 1e9, disk_read_gb_s=read / read_s / 1e9)
    with open(f"{args.out}/checkpoint_speed.jsonl", "w") as f:
        f.write(json.dumps(row) + "\n")
    print(f"checkpoint_speed: {args.model} on {args.ranks} {'GPU' if args.gpu else 'CPU'} ranks, {size / 1e9:.2f} GB "
          f"in {len(files)} files ({'cold reads' if cold else 'the page cache could not be dropped: reads may be warm'})")
    print(f"  save {save_s:.2f} s ({row['save_gb_s']:.2f} GB/s); the disk writes {row['disk_write_gb_s']:.2f} GB/s "
          f"({args.ranks} writers, synced): save / disk {save_s / (size / (written / write_s)):.2f}")
    print(f"  load {load_s:.2f} s ({row['load_gb_s']:.2f} GB/s); the disk reads {row['disk_read_gb_s']:.2f} GB/s "
          f"({len(files)} readers): load / disk {load_s / (size / (read / read_s)):.2f}")


if __name__ == "__main__":
    main()
