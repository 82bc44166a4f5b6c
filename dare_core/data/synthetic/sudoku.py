"""4x4 Sudoku (2x2 boxes) with a unique solution, graded by the `sudoku` reward.

Each row takes one of the 288 solved 4x4 grids and blanks `num_blanks` random cells (default 6, at
most 12), redrawing until the puzzle has exactly one solution.

Format contract:
- prompt: the 16 cells in row order, `0` for a blank, e.g. `"1030000100400200"`; with `instruction`,
  one short line follows saying how to answer;
- `answer_format="tag"` (default): response `<answer>1234341221434321</answer>`;
- `answer_format="plain"`: response `1234341221434321`, the whole response is the answer;
- ground truth: `"<puzzle>|<solution>[|plain]"` (see `dare_core.rewards.sudoku`).
"""
from __future__ import annotations

import random
from functools import lru_cache

from dare_core.data.synthetic.registry import register_task
from dare_core.rewards.sudoku import FORMATS, format_ground_truth

SIZE, BOX = 4, 2
CELLS = SIZE * SIZE
# 4 clues are the fewest a 4x4 puzzle with one solution can have.
MAX_BLANKS = 12
_INSTRUCTIONS = {
    "tag": "Fill the 0s of this 4x4 sudoku (rows in order). Answer as <answer>16 digits</answer>.",
    "plain": "Fill the 0s of this 4x4 sudoku (rows in order). Answer with the 16 digits only.",
}


def _peers(cell: int) -> set[int]:
    row, col = divmod(cell, SIZE)
    box_row, box_col = row - row % BOX, col - col % BOX
    same = {row * SIZE + c for c in range(SIZE)} | {r * SIZE + col for r in range(SIZE)}
    same |= {(box_row + r) * SIZE + box_col + c for r in range(BOX) for c in range(BOX)}
    return same - {cell}


PEERS = [_peers(cell) for cell in range(CELLS)]


@lru_cache(maxsize=1)
def all_solutions() -> tuple[str, ...]:
    """Every solved 4x4 grid (there are 288), as 16-digit strings, in lexicographic order."""
    grids: list[str] = []
    grid = [0] * CELLS

    def fill(cell: int) -> None:
        if cell == CELLS:
            grids.append("".join(map(str, grid)))
            return
        for digit in range(1, SIZE + 1):
            if all(grid[peer] != digit for peer in PEERS[cell] if peer < cell):
                grid[cell] = digit
                fill(cell + 1)
        grid[cell] = 0

    fill(0)
    return tuple(grids)


def is_valid_solution(grid: str) -> bool:
    return (len(grid) == CELLS and set(grid) <= set("1234")
            and all(grid[cell] != grid[peer] for cell in range(CELLS) for peer in PEERS[cell]))


@lru_cache(maxsize=1)
def _conflict_masks() -> tuple[tuple[int, ...], ...]:
    """Per solution, the minimal sets (bit masks) of cells in which some other solution differs from it.

    Blanking cells B of solution S leaves a unique puzzle iff no such set lies inside B."""
    grids = all_solutions()
    masks = []
    for grid in grids:
        diffs = sorted({sum(1 << i for i in range(CELLS) if grid[i] != other[i]) for other in grids if other != grid},
                       key=lambda m: bin(m).count("1"))
        minimal: list[int] = []
        for mask in diffs:
            if not any(m & mask == m for m in minimal):
                minimal.append(mask)
        masks.append(tuple(minimal))
    return tuple(masks)


def count_solutions(puzzle: str, limit: int = 2) -> int:
    """Solutions of a puzzle (`0` = blank), counted up to `limit`."""
    found = 0
    for grid in all_solutions():
        if all(p == "0" or p == g for p, g in zip(puzzle, grid)):
            found += 1
            if found >= limit:
                break
    return found


@register_task("sudoku")
class SudokuTask:
    reward = "sudoku"

    def generate(self, n: int, seed: int, num_blanks: int = 6, answer_format: str = "tag",
                 instruction: bool = True) -> list[dict]:
        if not 1 <= num_blanks <= MAX_BLANKS:
            raise ValueError(f"sudoku: num_blanks must be in 1..{MAX_BLANKS}, got {num_blanks}")
        if answer_format not in FORMATS:
            raise ValueError(f"sudoku: answer_format must be one of {FORMATS}, got {answer_format!r}")
        rng = random.Random(seed)
        solutions, conflicts = all_solutions(), _conflict_masks()
        rows = []
        for _ in range(n):
            for _attempt in range(100_000):
                index = rng.randrange(len(solutions))
                blanks = rng.sample(range(CELLS), num_blanks)
                mask = sum(1 << i for i in blanks)
                if not any(conflict & mask == conflict for conflict in conflicts[index]):
                    break
            else:  # pragma: no cover - every num_blanks <= 12 has unique puzzles
                raise ValueError(f"sudoku: no puzzle with one solution found for num_blanks={num_blanks}")
            solution = solutions[index]
            puzzle = "".join("0" if mask >> i & 1 else digit for i, digit in enumerate(solution))
            prompt = puzzle + ("\n" + _INSTRUCTIONS[answer_format] if instruction else "")
            response = f"<answer>{solution}</answer>" if answer_format == "tag" else solution
            rows.append({"prompt": prompt, "response": response,
                         "ground_truth": format_ground_truth(puzzle, solution, answer_format), "task": self.name})
        return rows
