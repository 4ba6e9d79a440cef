#!/usr/bin/env bash
# No strategy name is compared as a string outside src/strategies: callers ask the strategy's
# descriptor (StrategyInfo, strategy.hpp) what they need to know. The names come from the
# descriptors themselves (`.info = {"..."` or `.name = "..."` in src/strategies/*.cpp); a comparison is `==` or
# `!=` with one of them as a string literal on either side, in C++ or Python under src, cli,
# include and python. Fails listing every hit.
# Usage: check_strategy_names.sh SOURCE_DIR
set -euo pipefail
root=${1:?usage: check_strategy_names.sh SOURCE_DIR}
names=$(grep -hoE '\.info = \{"[a-z0-9-]+"|\.name = "[a-z0-9-]+"' "$root"/src/strategies/*.cpp |
        sed 's/.*"\(.*\)"/\1/' | sort -u)
if [ -z "$names" ]; then
  echo "no strategy names found in $root/src/strategies (descriptor format changed?)" >&2
  exit 1
fi
alt=$(printf '%s\n' $names | sed 's/-/\\-/g' | paste -sd'|')
lit="[\"'](${alt})[\"']"
pattern="(==|!=)[[:space:]]*${lit}|${lit}[[:space:]]*(==|!=)"
hits=$(cd "$root" && grep -rnE --include='*.cpp' --include='*.hpp' --include='*.h' \
         --include='*.py' --include='*.cu' "$pattern" src cli include python |
       grep -v '^src/strategies/' || true)
if [ -n "$hits" ]; then
  echo "strategy names compared as strings outside src/strategies (ask the descriptor," >&2
  echo "StrategyInfo in include/treeattn/strategy.hpp, instead):" >&2
  echo "$hits" >&2
  exit 1
fi
echo "ok: no comparison with any of $(echo $names | wc -w) strategy names ($(echo $names)) outside src/strategies"
