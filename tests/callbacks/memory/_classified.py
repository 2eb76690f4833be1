"""A snapshot written by hand whose every block exercises one rule of the classification by tensors.

Its peak and per-category numbers are worked out by hand in the docstring of :func:`classified_snapshot`.
"""

from __future__ import annotations

from lightning_cp.callbacks.memory.tensors import BUFFERS, GRADIENTS, OPTIMIZER_STATE, PARAMETERS

MiB = 2**20

KiB = 2**10

P = 256 * MiB  # segment allocated before the trace: blocks A, B, C, D

S = 512 * MiB  # segment the trace allocates: blocks E, then F at the same address

FRAMES_E = [{"filename": "/home/me/project/model.py", "line": 12, "name": "forward"}]

FRAMES_F = [
    {"filename": "/venv/lib/python3.11/site-packages/torch/autograd/graph.py", "line": 8, "name": "run"}
]


def classified_snapshot() -> dict:
    """One device. Before the trace: A 4 MiB (parameters: weight and bias), B 2 MiB (optimizer state),
    C 2 MiB (the previous step's gradient, freed in the trace), D 1 MiB (holds no known tensor): 9 MiB.

    Events: 0 segment +8 MiB (9); 1 alloc E 3 MiB, an activation (12 = peak); 2-3 free C (10);
    4-5 free E (7); 6 alloc F 2 MiB at E's address, the new gradient (9).

    At the peak (index 2, "at event 1"): parameters 4, activations 3, gradients 2 (C), optimizer state 2,
    other 1 = 12 MiB; shares 33.3 / 25.0 / 16.7 / 16.7 / 8.3 %.
    """

    def ev(action: str, addr: int, size: int, frames: list[dict] = ()) -> dict:
        return {"action": action, "addr": addr, "size": size, "stream": 0, "frames": list(frames)}

    trace = [
        ev("segment_alloc", S, 8 * MiB),
        ev("alloc", S, 3 * MiB, FRAMES_E),
        ev("free_requested", P + 6 * MiB, 2 * MiB),
        ev("free_completed", P + 6 * MiB, 2 * MiB),
        ev("free_requested", S, 3 * MiB),
        ev("free_completed", S, 3 * MiB),
        ev("alloc", S, 2 * MiB, FRAMES_F),
    ]

    def block(addr: int, size: int, state: str, frames: list[dict] = ()) -> dict:
        return {"address": addr, "size": size, "requested_size": size, "state": state, "frames": list(frames)}

    def segment(addr: int, size: int, blocks: list[dict]) -> dict:
        return {"device": 0, "address": addr, "total_size": size, "stream": 0, "blocks": blocks}

    return {
        "segments": [
            segment(
                P,
                10 * MiB,
                [
                    block(P, 4 * MiB, "active_allocated"),  # A
                    block(P + 4 * MiB, 2 * MiB, "active_allocated"),  # B
                    block(P + 6 * MiB, 2 * MiB, "inactive"),  # C, freed
                    block(P + 8 * MiB, 1 * MiB, "active_allocated"),  # D
                    block(P + 9 * MiB, 1 * MiB, "inactive"),
                ],
            ),
            segment(
                S,
                8 * MiB,
                [block(S, 2 * MiB, "active_allocated", FRAMES_F), block(S + 2 * MiB, 6 * MiB, "inactive")],
            ),
        ],
        "device_traces": [trace],
    }


# The tensors when the snapshot is taken (``tensors``) and when recording started (``tensors_at_start``).
TENSORS = {
    (P + 3 * MiB, P + 3 * MiB + 4 * KiB): (PARAMETERS, "layers.0.bias"),  # listed first, lies after weight
    (P, P + 3 * MiB): (PARAMETERS, "layers.0.weight"),
    (P + 4 * MiB, P + 6 * MiB): (OPTIMIZER_STATE, "exp_avg of layers.0.weight"),
    (S, S + 2 * MiB): (GRADIENTS, "layers.0.weight"),  # F: live now; E, freed, is at the same address
    (P + 7 * MiB, P + 7 * MiB + KiB): (GRADIENTS, "in C, which is freed"),
    (P + 9 * MiB - KiB, P + 9 * MiB + KiB): (BUFFERS, "straddles D's end"),
    (64 * MiB, 65 * MiB): (PARAMETERS, "in no block"),
}

TENSORS_AT_START = {
    (P + 6 * MiB, P + 8 * MiB): (GRADIENTS, "layers.0.weight"),  # C
    (P + 8 * MiB, P + 8 * MiB + KiB): (GRADIENTS, "in D, which stays live"),
    (P, P + 3 * MiB): (GRADIENTS, "in A, which stays live"),
}
