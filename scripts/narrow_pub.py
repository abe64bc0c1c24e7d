#!/usr/bin/env python3
"""Narrow `pub` items of crates/shardkit/src to pub(crate) unless the workspace (CLI, Python
bindings, bench, tests, examples, doctests) needs them, or they would become dead code.

Usage (from a clean working tree; NARROW_ONLY=io/,json.rs limits it to those paths; review `git diff` after, then fmt, clippy and the tests):
  scripts/narrow_pub.py fn                         narrow every `pub fn`, restore what breaks
  scripts/narrow_pub.py struct,enum,type,const     the same for those kinds
  scripts/narrow_pub.py continue                   resume the restore loop on the current diff
Each round runs `cargo check` of the workspace (with the test features) and of the library alone,
restores an item named by a privacy error, a dead-code warning or a private-interface warning,
and stops when a round restores nothing; then it does the same for the doctests.
"""
import json, re, subprocess, sys, pathlib, collections
ROOT = pathlib.Path(__file__).resolve().parents[1]
SRC = ROOT / 'crates/shardkit/src'
KINDS = sys.argv[1].split(',') if len(sys.argv) > 1 else ['fn']
ITEM = re.compile(r'^(\s*)pub ((?:const |unsafe |async )*)(' + '|'.join(KINDS) + r') ([A-Za-z_][A-Za-z0-9_]*)')
changed = {}  # (file, lineno) -> name
if KINDS == ['continue']:
    import subprocess as sp_
    diff = sp_.run(['git', 'diff', '-U0', '--', 'crates/shardkit/src'], cwd=ROOT, capture_output=True, text=True).stdout
    cur = None; ln = 0
    for l in diff.split('\n'):
        if l.startswith('+++ b/'): cur = str(ROOT / l[6:])
        elif l.startswith('@@'):
            ln = int(re.search(r'\+(\d+)', l).group(1))
        elif l.startswith('+') and not l.startswith('+++'):
            m = re.match(r'^(\s*)pub\(crate\) ((?:const |unsafe |async )*)(fn|struct|enum|trait|type|const|static|mod) ([A-Za-z_][A-Za-z0-9_]*)', l[1:])
            if m: changed[(cur, ln)] = m.group(4)
            ln += 1
    KINDS = ['__none__']
    ITEM = re.compile(r'(?!x)x(a)(b)(c)(d)')
# NARROW_ONLY=io/,engine/,json.rs narrows only files under those paths (relative to src/).
ONLY = [x for x in __import__('os').environ.get('NARROW_ONLY', '').split(',') if x]
for f in sorted(SRC.rglob('*.rs')):
    if f.name == 'internals.rs':
        continue
    if ONLY and not any(str(f.relative_to(SRC)).startswith(o) for o in ONLY):
        continue
    lines = f.read_text().split('\n')
    for i, l in enumerate(lines):
        m = ITEM.match(l)
        if m:
            lines[i] = l.replace('pub ', 'pub(crate) ', 1)
            changed[(str(f), i + 1)] = m.group(4)
    f.write_text('\n'.join(lines))
print(f'narrowed {len(changed)}', flush=True)
by_name = collections.defaultdict(list)
for k, n in changed.items():
    by_name[n].append(k)

def restore(key):
    if key not in changed:
        return False
    f, ln = key
    lines = pathlib.Path(f).read_text().split('\n')
    l = lines[ln - 1]
    if 'pub(crate) ' not in l:
        return False
    lines[ln - 1] = l.replace('pub(crate) ', 'pub ', 1)
    pathlib.Path(f).write_text('\n'.join(lines))
    del changed[key]
    return True

def restore_name(name):
    return sum(restore(k) for k in list(by_name.get(name, [])))

NAME = re.compile(r'`([A-Za-z_][A-Za-z0-9_]*)`')
FEAT = ['--features', 'shardkit/fault-injection,shardkit/bench-internals']

def check(cmd):
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env={**__import__('os').environ, 'CARGO_INCREMENTAL': '0'})
    return p.stdout + '\n' + p.stderr

def spans(msg):
    for sp in msg.get('spans', []):
        yield sp
    for ch in msg.get('children', []):
        yield from spans(ch)

DEAD = re.compile(r'(?:function|method|associated function|constant|static|type alias|methods|associated items)[^`]*`([A-Za-z_][A-Za-z0-9_]*)`.*never used')
for rnd in range(40):
    out = check(['cargo', 'check', '--workspace', '--all-targets', '--message-format=json'] + FEAT)
    out2 = check(['cargo', 'check', '-p', 'shardkit', '--lib', '--message-format=json'])
    fixed = 0; other = []
    for line in (out + '\n' + out2).split('\n'):
        try: m = json.loads(line)
        except Exception: continue
        if m.get('reason') != 'compiler-message': continue
        msg = m['message']
        code = (msg.get('code') or {}).get('code')
        text = msg['message']
        if code in ('E0624', 'E0603', 'E0364', 'E0365') or 'is private' in text or 'cannot be re-exported' in text:
            hit = False
            for sp in spans(msg):
                key = (str(ROOT / sp['file_name']) if not sp['file_name'].startswith('/') else sp['file_name'], sp['line_start'])
                if restore(key): hit = True; fixed += 1
            if not hit:
                for n in NAME.findall(text):
                    fixed += restore_name(n)
        elif code in ('dead_code', 'private_interfaces', 'private_bounds', 'unused_imports'):
            names = re.findall(r'`([A-Za-z_][A-Za-z0-9_]*)`', text)
            for sp in spans(msg):
                key = (str(ROOT / sp['file_name']), sp['line_start'])
                if restore(key): fixed += 1
            for n in names:
                fixed += restore_name(n)
        elif msg['level'] == 'error':
            other.append(msg.get('rendered') or text)
    print(f'round {rnd}: restored {fixed}, other errors {len(other)}', flush=True)
    if fixed == 0:
        for o in other[:10]: print(o)
        break
# doctests
for rnd in range(6):
    out = check(['cargo', 'test', '-p', 'shardkit', '--doc'] + ['--features', 'fault-injection,bench-internals'])
    names = set(re.findall(r'error\[E0(?:624|603)\]: \w+(?: \w+)? `([A-Za-z_][A-Za-z0-9_]*)` is private', out))
    fixed = sum(restore_name(n) for n in names)
    print(f'doc round {rnd}: private {sorted(names)} restored {fixed}', flush=True)
    if fixed == 0:
        if 'test result: FAILED' in out or 'error[' in out:
            print(out[-3000:])
        break
print(f'left narrowed: {len(changed)}')
