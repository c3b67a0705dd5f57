// Oracle: the root CID npm `ipfs-unixfs-importer` gives a directory on disk, with Kubo's
// settings (`ipfs add -r --cid-version=1`, or plain `ipfs add -r` for CIDv0): files as in
// unixfs_cid.mjs (fixed 256 KiB chunks, balanced layout of 174 links, raw leaves for v1),
// directories sharded into HAMTs of fanout 256 (shardFanoutBits 8) when the "links"
// estimate (name bytes + CID bytes per entry, shardSplitStrategy 'links-bytes') is above
// 262144 bytes, as boxo's default does.
//
// Two modes:
//   kubo  (default) each directory is imported on its own, bottom up, its subdirectories
//         given as already-built entries through the importer's `dirBuilder` option.
//         That is how Kubo's MFS builds the tree, and it makes a subdirectory count in its
//         parent's shard estimate; the importer's own tree builder leaves out entries whose
//         CID is not known yet, so subdirectories never count there.
//   paths the importer's own tree builder, every file given by its relative path (the
//         two agree unless a directory's subdirectories decide whether it shards).
// Every entry is imported: hidden files included (the tests make none they want counted).
//
//   node tests/oracles/unixfs_dir.mjs DIR [--cid-version 0|1] [--mode kubo|paths]
//   node tests/oracles/unixfs_dir.mjs --serve   # JSON lines on stdin:
//       {"dir": DIR, "cidVersion": 1, "mode": "kubo"} -> {"cid": "..."}
//       {"murmur3": HEX} -> {"hash": HEX}   (the HAMT hash of those bytes, as read: 8 bytes)
// Blocks are hashed and dropped: nothing is stored.
import { createReadStream } from 'node:fs'
import { readdir } from 'node:fs/promises'
import { join } from 'node:path'
import { createInterface } from 'node:readline'
import { murmur3128 } from '@multiformats/murmur3'
import { importer } from 'ipfs-unixfs-importer'
import { fixedSize } from 'ipfs-unixfs-importer/chunker'
import { balanced } from 'ipfs-unixfs-importer/layout'

const nullBlockstore = { put: async (cid) => cid, get: async () => { throw new Error('no get') }, has: async () => false }

function kuboOptions (cidVersion) {
  return {
    cidVersion,
    rawLeaves: cidVersion === 1,
    leafType: 'file',
    reduceSingleLeafToSelf: true,
    chunker: fixedSize({ chunkSize: 262144 }),
    layout: balanced({ maxChildrenPerNode: 174 }),
    shardSplitThresholdBytes: 262144,
    shardSplitStrategy: 'links-bytes',
    shardFanoutBits: 8,
    wrapWithDirectory: true
  }
}

async function last (candidates, options) {
  let out
  for await (const entry of importer(candidates, nullBlockstore, options)) out = entry
  return out
}

// kubo mode: {cid, size} of one directory, its subdirectories imported first.
async function importBottomUp (dir, cidVersion) {
  const built = new Map()
  const candidates = []
  for (const entry of await readdir(dir, { withFileTypes: true })) {
    const path = join(dir, entry.name)
    if (entry.isDirectory()) {
      built.set(entry.name, await importBottomUp(path, cidVersion))
      candidates.push({ path: entry.name })
    } else if (entry.isFile()) {
      candidates.push({ path: entry.name, content: createReadStream(path) })
    } else {
      throw new Error(`${path} is neither a file nor a directory`)
    }
  }
  const dirBuilder = async (d) => {
    const { cid, size } = built.get(d.path)
    // Only isDirectory() is asked of it: it keeps the entry out of the file results.
    return { cid, size, path: d.path, unixfs: { type: 'directory', isDirectory: () => true } }
  }
  return last(candidates, { ...kuboOptions(cidVersion), dirBuilder })
}

// paths mode: every file (and every empty directory) by its path below `root`.
async function * pathCandidates (root, prefix = '') {
  const entries = await readdir(join(root, prefix), { withFileTypes: true })
  if (entries.length === 0 && prefix !== '') yield { path: prefix }
  for (const entry of entries) {
    const rel = prefix === '' ? entry.name : `${prefix}/${entry.name}`
    if (entry.isDirectory()) yield * pathCandidates(root, rel)
    else yield { path: rel, content: createReadStream(join(root, rel)) }
  }
}

async function cidOf ({ dir, cidVersion = 1, mode = 'kubo' }) {
  if (mode === 'kubo') return (await importBottomUp(dir, cidVersion)).cid.toString()
  if (mode === 'paths') return (await last(pathCandidates(dir), kuboOptions(cidVersion))).cid.toString()
  throw new Error(`unknown mode ${mode}`)
}

// The importer's HAMT hash: murmur3-x64-128's first 64 bits, reversed, then read from the
// last byte back (hamt-sharding's ConsumableBuffer); returned in reading order.
async function murmur (hex) {
  const digest = await murmur3128.encode(Buffer.from(hex, 'hex'))
  return Buffer.from(digest.slice(0, 8)).toString('hex')
}

async function answer (req) {
  if (req.murmur3 !== undefined) return { hash: await murmur(req.murmur3) }
  return { cid: await cidOf(req) }
}

const args = process.argv.slice(2)
if (args[0] === '--serve') {
  const rl = createInterface({ input: process.stdin, crlfDelay: Infinity })
  for await (const line of rl) {
    if (!line.trim()) continue
    try {
      process.stdout.write(JSON.stringify(await answer(JSON.parse(line))) + '\n')
    } catch (err) {
      process.stdout.write(JSON.stringify({ error: String(err) }) + '\n')
    }
  }
} else {
  const req = { dir: args[0] }
  for (let i = 1; i < args.length; i += 2) {
    const key = { '--cid-version': 'cidVersion', '--mode': 'mode' }[args[i]]
    if (!key) { console.error(`unknown option ${args[i]}`); process.exit(2) }
    req[key] = key === 'cidVersion' ? Number(args[i + 1]) : args[i + 1]
  }
  console.log(await cidOf(req))
}
