# Alternating processes of two trees: bash batch_ab.sh OLD_SRC NEW_SRC B N ROUNDS
for r in $(seq "$5"); do
  for tree in $( [ $((r % 2)) = 1 ] && echo "$1 $2" || echo "$2 $1" ); do
    tag=$( [ "$tree" = "$1" ] && echo old || echo new )
    PYTHONPATH="$tree" .venv/bin/python docs/bench/session31/batch_ab.py "$3" "$4" "$tag" 2>&1 | grep -E "^(old|new) "
  done
done
