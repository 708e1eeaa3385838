#!/usr/bin/env node
/*
 * Joyent's node-sdc-changefeed listener (npm package `changefeed`), as Triton's
 * services use it, pointed at a publisher of this project. It bootstraps
 * nothing itself: it prints what the listener gives it, one JSON object per
 * line on stdout, for a test to read.
 *
 *   node listener.js --url http://127.0.0.1:8080 --resource vm=nic,alias
 *   node listener.js --url ... --resource vm=nic,alias --resource server=status
 *
 * One --resource registers the v1 way (`changeKind`); several, the v2 way
 * (`resources`), as the package itself decides. Lines:
 *
 *   {"event": "registering", "version": 1|2}
 *   {"event": "bootstrap", "route": {...}}      once per resource (v2: each of bootstrapRoutes)
 *   {"event": "change", "item": {...}}          every change item, as the stream yields it
 *   {"event": "connection-end"} / {"event": "connection-reset"}
 *   {"event": "error", "message": "..."}
 *
 * The listener's own (bunyan) log goes to stderr. SIGTERM closes it and exits.
 */

'use strict';

var mod_bunyan = require('bunyan');
var mod_changefeed = require('changefeed');

function usage(message) {
    process.stderr.write('listener.js: ' + message + '\n' +
        'usage: listener.js --url URL --resource NAME[=SUB,SUB] ' +
        '[--resource ...] [--instance UUID] [--service NAME]\n');
    process.exit(2);
}

function parseArgs(argv) {
    var args = { resources: [], service: 'node-sdc-changefeed-test' };
    for (var i = 0; i < argv.length; i += 2) {
        var value = argv[i + 1];
        if (value === undefined) {
            usage('missing value for ' + argv[i]);
        }
        switch (argv[i]) {
        case '--url':
            args.url = value;
            break;
        case '--instance':
            args.instance = value;
            break;
        case '--service':
            args.service = value;
            break;
        case '--resource':
            var parts = value.split('=');
            args.resources.push({
                resource: parts[0],
                subResources: parts[1] ? parts[1].split(',') : []
            });
            break;
        default:
            usage('unknown option ' + argv[i]);
        }
    }
    if (!args.url || args.resources.length === 0) {
        usage('--url and at least one --resource are required');
    }
    return args;
}

function emit(doc) {
    process.stdout.write(JSON.stringify(doc) + '\n');
}

function main() {
    var args = parseArgs(process.argv.slice(2));
    var options = {
        log: mod_bunyan.createLogger({
            name: 'changefeed-listener',
            level: process.env.LOG_LEVEL || 'info',
            stream: process.stderr
        }),
        url: args.url,
        instance: args.instance || require('crypto').randomUUID(),
        service: args.service,
        backoff: { maxTimeout: Infinity, minTimeout: 10, retries: Infinity }
    };
    if (args.resources.length === 1) {
        options.changeKind = args.resources[0];
    } else {
        options.resources = args.resources;
    }

    var listener = mod_changefeed.createListener(options);

    listener.on('bootstrap', function onBootstrap(route) {
        emit({ event: 'bootstrap', route: route });
    });
    listener.on('readable', function onReadable() {
        var item;
        while ((item = listener.read()) !== null) {
            emit({ event: 'change', item: item });
        }
    });
    listener.on('connection-end', function onEnd() {
        emit({ event: 'connection-end' });
    });
    listener.on('connection-reset', function onReset() {
        emit({ event: 'connection-reset' });
    });
    listener.on('error', function onError(err) {
        emit({ event: 'error', message: String(err && err.message || err) });
    });

    process.on('SIGTERM', function onTerm() {
        listener.close();
        process.exit(0);
    });

    emit({ event: 'registering', version: args.resources.length === 1 ? 1 : 2 });
    listener.register();
}

main();
