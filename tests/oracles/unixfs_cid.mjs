// Oracle: the CID npm `ipfs-unixfs-importer` (js-ipfs' and Helia's importer) gives a file,
// with Kubo's settings: fixed 256 KiB chunks, balanced layout of 174 links, raw leaves for
// CIDv1 (`ipfs add --cid-version=1`), dag-pb leaves for CIDv0 (plain `ipfs add`).
//
//   node tests/oracles/unixfs_cid.mjs FILE [--cid-version 0|1] [--chunk-size N] [--max-links N]
//   node tests/oracles/unixfs_cid.mjs --serve   # JSON lines on stdin:
//       {"path": FILE, "cidVersion": 1, "chunkSize": 262144, "maxLinks": 174} -> {"cid": "..."}
// Blocks are hashed and dropped: nothing is stored.
import { createReadStream } from 'node:fs'
import { createInterface } from 'node:readline'
import { importer } from 'ipfs-unixfs-importer'
import { fixedSize } from 'ipfs-unixfs-importer/chunker'
import { balanced } from 'ipfs-unixfs-importer/layout'

const nullBlockstore = { put: async (cid) => cid, get: async () => { throw new Error('no get') }, has: async () => false }

async function cidOf ({ path, cidVersion = 1, chunkSize = 262144, maxLinks = 174 }) {
  const options = {
    cidVersion,
    rawLeaves: cidVersion === 1,
    leafType: 'file',
    reduceSingleLeafToSelf: true,
    chunker: fixedSize({ chunkSize }),
    layout: balanced({ maxChildrenPerNode: maxLinks }),
    wrapWithDirectory: false
  }
  let last
  for await (const entry of importer([{ content: createReadStream(path) }], nullBlockstore, options)) last = entry
  return last.cid.toString()
}

const args = process.argv.slice(2)
if (args[0] === '--serve') {
  const rl = createInterface({ input: process.stdin, crlfDelay: Infinity })
  for await (const line of rl) {
    if (!line.trim()) continue
    try {
      process.stdout.write(JSON.stringify({ cid: await cidOf(JSON.parse(line)) }) + '\n')
    } catch (err) {
      process.stdout.write(JSON.stringify({ error: String(err) }) + '\n')
    }
  }
} else {
  const req = { path: args[0] }
  for (let i = 1; i < args.length; i += 2) {
    const key = { '--cid-version': 'cidVersion', '--chunk-size': 'chunkSize', '--max-links': 'maxLinks' }[args[i]]
    if (!key) { console.error(`unknown option ${args[i]}`); process.exit(2) }
    req[key] = Number(args[i + 1])
  }
  console.log(await cidOf(req))
}
