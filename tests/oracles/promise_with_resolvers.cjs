// js-ipfs 0.66's dependencies call Promise.withResolvers (Node 22); Node 20 lacks it.
// Preloaded with NODE_OPTIONS="--require tests/oracles/promise_with_resolvers.cjs".
if (typeof Promise.withResolvers !== 'function') {
  Promise.withResolvers = function withResolvers () {
    let resolve, reject
    const promise = new Promise((res, rej) => { resolve = res; reject = rej })
    return { promise, resolve, reject }
  }
}
