"""What METRA's representation looks like: the paper's Figure 2 and its Appendix C.1 check, from one .npz.

    python metra.py --env-id Ant --save-repr-stats ...          # writes runs/<run>/repr_stats_<env steps>.npz
    python benchmarks/metra_repr_stats.py runs/<run>/repr_stats_0020000000.npz

The .npz holds Δφ = φ(s') - φ(s), the skill vector z (m for one-hot skills) and Δφ - z, Δφ/‖Δφ‖ for 10k replay
transitions. This script draws into one PNG:
  (a) the histogram of ‖Δφ‖² (paper Fig. 2a: its mean converges to 1, Prop. 1; 0.988 after 20M steps);
  (b) the per-dimension histograms of Δφ - z, against N(0, σ²) (Fig. 2b: Δφ | z ≈ N(z, σ² I));
  (c) the direction Δφ/‖Δφ‖: its angle for d = 2, else its coordinates, against Unif(S^{d-1}) (Fig. 2c);
  (d) Appendix C.1: log E_z[exp(Δφᵀz)], z ~ Unif(S^{d-1}) by Monte Carlo, against ‖Δφ‖², whose slope at 0 is
      1/(2d) (Prop. 2: 0.25 for d = 2; the paper fits 0.2309 by least squares over all samples).
and prints a table, also written with the PNG to benchmarks/results/metra_repr_stats_<env>_<env steps>.{md,png}.

The Monte Carlo uses antithetic pairs (z, -z), so the term linear in Δφ cancels exactly and small Δφ are not
drowned in sampling noise; for d = 2 and 3 it is checked against the closed forms log I_0(r) and log(sinh r / r).
"""

import argparse
import math
import os

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def log_mean_exp_sphere(dphi, num_z=16384, seed=0, chunk=1024):
    """log E_z[exp(Δφᵀz)] per row of dphi (N, d), z ~ Unif(S^{d-1}) by Monte Carlo on num_z antithetic draws."""
    rng = np.random.default_rng(seed)
    z = rng.standard_normal((num_z // 2, dphi.shape[1]))
    z /= np.linalg.norm(z, axis=1, keepdims=True)
    z = np.concatenate([z, -z])
    out = np.empty(len(dphi))
    for i in range(0, len(dphi), chunk):
        s = dphi[i:i + chunk] @ z.T
        top = s.max(1, keepdims=True)
        out[i:i + chunk] = top[:, 0] + np.log(np.exp(s - top).mean(1))
    return out


def exact_log_mean_exp_sphere(dphi):
    """The closed form of log E_z[exp(Δφᵀz)] where it is elementary: d = 2, log I_0(r); d = 3, log(sinh r / r)."""
    r = np.linalg.norm(dphi, axis=1)
    if dphi.shape[1] == 2:
        return np.log(np.i0(r))
    if dphi.shape[1] == 3:
        return np.where(r > 1e-8, r + np.log1p(-np.exp(-2 * r)) - np.log(2 * np.maximum(r, 1e-8)), r**2 / 6)
    return None


def fit_slopes(x, y, fit_max):
    """The slope of y(x) at 0: least squares of y = a x + b x² (no constant, since y(0) = 0) on the samples with
    x ≤ fit_max, whose a is the slope at 0 and b the curvature (theory: 1/(2d) and -1/(4d²(d+2))); and the
    least-squares line with an intercept over all samples (what the paper's App. C.1 figure fits)."""
    near = x <= fit_max
    a = b = float("nan")
    if near.sum() >= 3 and np.ptp(x[near]) > 0:
        (a, b), *_ = np.linalg.lstsq(np.stack([x[near], x[near] ** 2], 1), y[near], rcond=None)
    slope_all, intercept_all = np.polyfit(x, y, 1) if len(x) >= 2 else (float("nan"), float("nan"))
    return float(a), float(b), int(near.sum()), float(slope_all), float(intercept_all)


def sphere_coordinate_density(x, d):
    """Density of one coordinate of a uniform point on S^{d-1}: Γ(d/2) / (√π Γ((d-1)/2)) (1 - x²)^{(d-3)/2}."""
    log_c = math.lgamma(d / 2) - 0.5 * math.log(math.pi) - math.lgamma((d - 1) / 2)
    return np.exp(log_c) * np.clip(1 - x**2, 1e-12, None) ** ((d - 3) / 2)


def derived(dphi, z):
    """What the table and the plot read besides Δφ and z (metra.py saves those two): Δφ - z and Δφ/‖Δφ‖."""
    norm = np.linalg.norm(dphi, axis=1, keepdims=True)
    return {"dphi_minus_z": dphi - z, "dphi_unit": dphi / np.maximum(norm, 1e-12)}


def analyse(data, num_z=16384, fit_max=0.5, seed=0):
    """Every number of the table, from the arrays of one .npz."""
    dphi, dphi_minus_z, unit = data["dphi"], data["dphi_minus_z"], data["dphi_unit"]
    n, d = dphi.shape
    sq = (dphi**2).sum(1)
    lme = log_mean_exp_sphere(dphi, num_z, seed)
    exact = exact_log_mean_exp_sphere(dphi)
    slope_0, curvature, n_near, slope_all, intercept_all = fit_slopes(sq, lme, fit_max)
    return {
        "samples": n, "d": d, "E‖Δφ‖²": float(sq.mean()), "median ‖Δφ‖²": float(np.median(sq)),
        "fraction ‖Δφ‖² ≤ 1": float((sq <= 1).mean()),
        "Δφ - z: largest |mean| of a dimension": float(np.abs(dphi_minus_z.mean(0)).max()),
        "Δφ - z: std per dimension (min, max)": (float(dphi_minus_z.std(0).min()), float(dphi_minus_z.std(0).max())),
        "‖E[Δφ/‖Δφ‖]‖ (0 if uniform; noise ≈ 1/√N)": float(np.linalg.norm(unit.mean(0))),
        "theory: slope 1/(2d)": 1 / (2 * d),
        f"slope at 0 (fit a x + b x², ‖Δφ‖² ≤ {fit_max})": slope_0,
        "theory: curvature -1/(4d²(d+2))": -1 / (4 * d**2 * (d + 2)),
        "fitted curvature b": curvature,
        f"samples with ‖Δφ‖² ≤ {fit_max}": n_near,
        "least-squares slope, all samples (paper: 0.2309 at d = 2)": slope_all,
        "least-squares intercept, all samples": intercept_all,
        "Monte Carlo: max |error| against the closed form": float(np.abs(lme - exact).max()) if exact is not None else None,
    }, sq, lme


def plot(data, sq, lme, stats, fit_max, path, title):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dphi_minus_z, unit = data["dphi_minus_z"], data["dphi_unit"]
    d = unit.shape[1]
    fig, axes = plt.subplots(1, 4, figsize=(20, 4.5))
    ax = axes[0]
    ax.hist(sq, bins=60, density=True, color="tab:blue", alpha=0.8)
    ax.axvline(sq.mean(), color="k", ls="--", label=f"mean {sq.mean():.4g}")
    ax.axvline(1.0, color="tab:red", ls=":", label="1 (Prop. 1)")
    ax.set_xlabel("‖φ(s') - φ(s)‖²")
    ax.set_title("(a) expected constraint")
    ax.legend()

    ax = axes[1]
    sigma = dphi_minus_z.std()
    grid = np.linspace(dphi_minus_z.min(), dphi_minus_z.max(), 200)
    for i in range(min(d, 8)):
        ax.hist(dphi_minus_z[:, i], bins=60, density=True, histtype="step", label=f"dim {i}")
    ax.plot(grid, np.exp(-grid**2 / (2 * sigma**2)) / (sigma * math.sqrt(2 * math.pi)), "k--", label=f"N(0, {sigma:.3g}²)")
    ax.set_xlabel("φ(s') - φ(s) - z, per dimension" + (" (first 8)" if d > 8 else ""))
    ax.set_title("(b) Gaussianity")
    ax.legend(fontsize=7)

    ax = axes[2]
    if d == 2:
        ax.hist(np.arctan2(unit[:, 1], unit[:, 0]), bins=60, range=(-np.pi, np.pi), density=True, color="tab:green")
        ax.axhline(1 / (2 * np.pi), color="k", ls="--", label="Unif(S¹)")
        ax.set_xlabel("angle of (φ(s') - φ(s)) / ‖φ(s') - φ(s)‖")
    elif d > 2:
        for i in range(min(d, 8)):
            ax.hist(unit[:, i], bins=60, range=(-1, 1), density=True, histtype="step", label=f"dim {i}")
        grid = np.linspace(-0.999, 0.999, 400)
        ax.plot(grid, sphere_coordinate_density(grid, d), "k--", label=f"Unif(S^{d - 1})")
        ax.set_xlabel("coordinates of (φ(s') - φ(s)) / ‖φ(s') - φ(s)‖")
    ax.set_title("(c) uniformity")
    ax.legend(fontsize=7)

    ax = axes[3]
    show = np.random.default_rng(0).permutation(len(sq))[:3000]
    ax.scatter(sq[show], lme[show], s=3, alpha=0.4, color="tab:purple")
    grid = np.linspace(0, sq.max(), 100)
    keys = list(stats)
    slope_0 = stats[next(k for k in keys if k.startswith("slope at 0"))]
    curvature = stats["fitted curvature b"]
    slope_all = stats[next(k for k in keys if k.startswith("least-squares slope"))]
    intercept_all = stats["least-squares intercept, all samples"]
    ax.plot(grid, grid / (2 * d), "k--", label=f"‖Δφ‖²/(2d), slope {1 / (2 * d):.4g}")
    near = grid <= fit_max
    ax.plot(grid[near], slope_0 * grid[near] + curvature * grid[near] ** 2, color="tab:red",
            label=f"fit near 0, slope {slope_0:.4g}")
    ax.plot(grid, slope_all * grid + intercept_all, color="tab:orange", label=f"least squares, slope {slope_all:.4g}")
    ax.set_xlabel("‖φ(s') - φ(s)‖²")
    ax.set_ylabel("log E_z[exp((φ(s') - φ(s))ᵀz)]")
    ax.set_title("(d) quadratic approximation (App. C.1)")
    ax.legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("npz", help="a repr_stats_<env steps>.npz written by metra.py --save-repr-stats")
    parser.add_argument("--num-z", type=int, default=16384, help="Monte Carlo skills z ~ Unif(S^{d-1}) (antithetic)")
    parser.add_argument("--fit-max", type=float, default=0.5, help="‖Δφ‖² range [0, fit-max] of the slope at 0")
    parser.add_argument("--out-dir", default=os.path.join(ROOT, "benchmarks", "results"), help="where the .md and .png go")
    parser.add_argument("--name", default=None, help="file stem (unset: metra_repr_stats_<env>_<env steps>)")
    args = parser.parse_args(argv)
    with np.load(args.npz) as f:
        data = {k: f[k] for k in f.files}
    data |= derived(data["dphi"], data["z"])
    env_id = str(data.get("env_id", "unknown"))
    env_steps = int(data.get("env_steps", -1))
    discrete = bool(data.get("discrete", False))
    stats, sq, lme = analyse(data, args.num_z, args.fit_max)
    name = args.name or f"metra_repr_stats_{env_id}_{env_steps}"
    os.makedirs(args.out_dir, exist_ok=True)
    title = (f"METRA {env_id}, {env_steps:,} env steps, d = {stats['d']}"
             + (" (one-hot skills: z is m, the sphere prior of (d) is not the skill prior)" if discrete else ""))
    plot(data, sq, lme, stats, args.fit_max, os.path.join(args.out_dir, name + ".png"), title)

    def fmt(v):
        if v is None:
            return "–"
        if isinstance(v, tuple):
            return ", ".join(fmt(x) for x in v)
        return f"{v:,}" if isinstance(v, int) else f"{v:.4g}"

    table = "\n".join(["| quantity | value |", "|---|---|"] + [f"| {k} | {fmt(v)} |" for k, v in stats.items()])
    print(title)
    print(table)
    with open(os.path.join(args.out_dir, name + ".md"), "w") as f:
        f.write(f"# {title}\n\n`python benchmarks/metra_repr_stats.py {args.npz} --num-z {args.num_z} "
                f"--fit-max {args.fit_max}`\n\n{table}\n\n![Figure 2 and App. C.1]({name}.png)\n")
    return stats


if __name__ == "__main__":
    main()
