-- Early bids: every bid made within 2 s of event time after its auction opened (an interval
-- join of auctions and bids on the auction's id), with how long after the opening, µs.
SELECT A.id AS auction, B.bidder, B.price, B.event_time - A.event_time AS after
FROM auction AS A JOIN bid AS B
    ON A.id = B.auction AND B.event_time BETWEEN A.event_time AND A.event_time + 2000000
