#!/usr/bin/env bash
# Entrypoint of the DARE image (docker/Dockerfile): `dare` by default, any other program on request.
#
#   docker run dare:gpu stage sft          -> dare stage sft
#   docker run dare:gpu --help             -> dare --help   (also the image's CMD)
#   docker run dare:gpu dvc repro          -> dvc repro     (an executable on PATH runs as given)
#   docker run dare:gpu dare stage sft     -> dare stage sft
#   prefect flow-run execute               -> itself: the command a Prefect Docker worker gives
#                                             the container (prefect.yaml, dare-pipeline-docker)
#
# Rule: a `dare` subcommand or an option (or nothing) goes to `dare`; otherwise a first word that
# names an executable file on PATH, or a path to one, is run as the command; anything else goes to
# `dare`, which reports an unknown command. Subcommands win over programs of the same name, and
# shell builtins never count as programs (`eval` is `dare eval`, not the builtin).
set -euo pipefail

# The subcommands of dare_core/cli.py build_parser() (tests/test_docker.py keeps this list in sync).
DARE_COMMANDS=(stage upload run generate eval workspaces server)

is_dare_command() {
    local name
    for name in "${DARE_COMMANDS[@]}"; do
        [[ "$1" == "$name" ]] && return 0
    done
    return 1
}

# The program the first word names: itself when it is a path, else the first match on PATH (bash
# may report a file there that is not executable, hence the -x test).
program_of() {
    if [[ "$1" == */* ]]; then
        printf '%s' "$1"
    else
        type -P -- "$1" || true
    fi
}

if [[ $# -eq 0 ]] || [[ "$1" == -* ]] || is_dare_command "$1"; then
    set -- dare "$@"
else
    program="$(program_of "$1")"
    if [[ -z "${program}" || ! -f "${program}" || ! -x "${program}" ]]; then
        set -- dare "$@"
    fi
fi

exec "$@"
