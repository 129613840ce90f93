"""The end-of-run summary printed by `longdoc train` (rank 0)."""

from __future__ import annotations


def summary(result) -> str:
    """Loss first -> last, throughput, step time, peak memory and where the outputs are; "" off rank 0."""
    if not result.is_main:
        return ""
    out = result.output_dir
    lines = [f"longdoc train: done, {result.steps_done} steps (world {result.world_size}, cp {result.cp_size})"]
    h = result.history
    if h:
        steady = h[1:] if len(h) > 1 else h
        lines.append(f"  loss            {h[0].loss:.4f} (step {h[0].step}) -> {h[-1].loss:.4f} (step {h[-1].step})")
        lines.append(f"  tokens/s        {result.tokens_per_s():,.0f} (all ranks, steps after the first)")
        lines.append(f"  step time       {sum(s.step_s for s in steady) / len(steady):.2f} s")
        lines.append(f"  peak memory     {max(s.peak_gb_max for s in h):.2f} GB per rank (largest rank)")
    else:
        lines.append("  nothing to do: the latest checkpoint is already at train.steps")
    lines.append(f"  metrics         {out / 'metrics.jsonl'} (TensorBoard: tensorboard --logdir {out})")
    if (out / "loss.png").is_file():
        lines.append(f"  loss curve      {out / 'loss.png'}")
    if result.last_checkpoint is not None:
        lines.append(f"  checkpoint      {result.last_checkpoint}")
    if result.final_dir is not None:
        lines.append(f"  model           {result.final_dir} (save_pretrained, safetensors)")
    return "\n".join(lines)
